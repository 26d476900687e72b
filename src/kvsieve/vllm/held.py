"""What one request's cache holds in a vLLM worker once kvsieve has compacted it, and what its last window queries
yielded."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


@dataclass
class RecentMeasures:
    """What the last `window` queries of one layer yielded (`Needs.window_measures`, by name) and their positions."""

    window: int
    measured: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [q_heads, w, k]
    positions: torch.Tensor | None = None  # [w]

    def append(self, measured: Mapping[str, torch.Tensor], positions: torch.Tensor) -> None:
        """Add what queries at `positions [n]` yielded (name -> `[q_heads, n, k]`), keeping the last `window`."""
        for name, value in measured.items():
            held = self.measured.get(name)
            self.measured[name] = (value if held is None else torch.cat([held, value], dim=1))[:, -self.window :]
        held = self.positions
        self.positions = (positions if held is None else torch.cat([held, positions]))[-self.window :]


@dataclass
class HeldCache:
    """One request's cache in a worker: after a compaction, cache indices `[0, C)` hold each (layer, kv-head)'s kept
    entries and every later token at position `p` sits at cache index `p - evicted`.

    Attributes:
        evicted: entries removed from the request's cache index space (`d`); 0 until the first compaction.
        kept: per layer index, `[kv_heads, C]` the positions of the entries at cache indices `[0, C)`.
        recent: per layer index, what the last window queries yielded (when the policy reads them).
    """

    evicted: int = 0
    kept: dict[int, torch.Tensor] = field(default_factory=dict)
    recent: dict[int, RecentMeasures] = field(default_factory=dict)

    @property
    def compacted(self) -> int:
        """C: the entries per (layer, kv-head) the last compaction kept."""
        return next(iter(self.kept.values())).shape[1] if self.kept else 0

    def positions(self, layer_idx: int, kv_heads: int, stored: int) -> torch.Tensor:
        """`[kv_heads, stored]` the token positions of a layer's entries at cache indices `[0, stored)`."""
        compacted = self.compacted
        appended = torch.arange(compacted + self.evicted, stored + self.evicted).expand(kv_heads, -1)
        if not compacted:
            return appended
        return torch.cat([self.kept[layer_idx], appended], dim=1)
