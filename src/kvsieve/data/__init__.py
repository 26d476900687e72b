"""Offline corpora and task generators."""

from .essays import essay_texts, sample_documents

__all__ = ["essay_texts", "sample_documents"]
