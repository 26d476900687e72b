"""Scoring rules, one per file; `SCORERS` maps each name to its class."""

from .base import Scorer
from .importance import ImportanceScorer
from .knorm import KnormScorer
from .random import RandomScorer
from .streaming import StreamingScorer
from .window import WindowScorer

SCORERS: dict[str, type] = {
    cls.name: cls for cls in (ImportanceScorer, WindowScorer, RandomScorer, StreamingScorer, KnormScorer)
}

__all__ = [
    "SCORERS",
    "ImportanceScorer",
    "KnormScorer",
    "RandomScorer",
    "Scorer",
    "StreamingScorer",
    "WindowScorer",
]
