"""What a cache holds for one sequence: the size a stream reports after each chunk (`harness.eval.streams`).

Its own module so that the streams kvsieve measures (`harness.eval`) and the ones it runs beside them
(`harness.compare`) share it without either folder importing the other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheSize:
    """What a cache holds for one sequence: bytes of keys and values, storage allocated, entries per head."""

    nbytes: int = 0
    allocated: int = 0
    entries: float = 0.0

    def peak(self, other: CacheSize) -> CacheSize:
        return CacheSize(
            max(self.nbytes, other.nbytes), max(self.allocated, other.allocated), max(self.entries, other.entries)
        )
