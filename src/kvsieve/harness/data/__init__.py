"""Offline corpora and task generators."""

from .essays import document_windows, essay_split, essay_texts, long_context, sample_documents, validation_documents
from .routing import ROUTING_FAMILIES, routing_samples
from .ruler import RULER_TASKS, ruler_samples
from .sample import EncodedSample, TaskSample, encode
from .suites import SUITES, resolve_tasks, task_samples

__all__ = [
    "ROUTING_FAMILIES",
    "RULER_TASKS",
    "SUITES",
    "EncodedSample",
    "TaskSample",
    "document_windows",
    "encode",
    "essay_split",
    "essay_texts",
    "long_context",
    "resolve_tasks",
    "routing_samples",
    "ruler_samples",
    "sample_documents",
    "task_samples",
    "validation_documents",
]
