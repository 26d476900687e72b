"""Scoring rules, one per file; `SCORERS` maps each name to its class."""

from .base import Scorer
from .caote import CAOTEScorer
from .critical import CriticalScorer
from .dropkv import DropKVScorer
from .expected import ExpectedScorer
from .h2o import H2OScorer
from .importance import ImportanceScorer
from .keydiff import KeyDiffScorer
from .knorm import KnormScorer
from .kvzip import KVzipScorer
from .random import RandomScorer
from .snapkv import SnapKVScorer
from .streaming import StreamingScorer
from .tova import TOVAScorer
from .trimkv import TrimKVScorer
from .vatp import VATPScorer
from .window import WindowScorer

SCORERS: dict[str, type] = {
    cls.name: cls
    for cls in (
        ImportanceScorer,
        WindowScorer,
        RandomScorer,
        StreamingScorer,
        KnormScorer,
        SnapKVScorer,
        TOVAScorer,
        H2OScorer,
        ExpectedScorer,
        KeyDiffScorer,
        VATPScorer,
        CAOTEScorer,
        DropKVScorer,
        CriticalScorer,
        TrimKVScorer,
        KVzipScorer,
    )
}

__all__ = [
    "SCORERS",
    "CAOTEScorer",
    "CriticalScorer",
    "DropKVScorer",
    "ExpectedScorer",
    "H2OScorer",
    "ImportanceScorer",
    "KVzipScorer",
    "KeyDiffScorer",
    "KnormScorer",
    "RandomScorer",
    "Scorer",
    "SnapKVScorer",
    "StreamingScorer",
    "TOVAScorer",
    "TrimKVScorer",
    "VATPScorer",
    "WindowScorer",
]
