"""Offline corpora and task generators."""

from .essays import essay_texts, long_context, sample_documents

__all__ = ["essay_texts", "long_context", "sample_documents"]
