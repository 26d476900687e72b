"""What one request's cache holds in a vLLM worker once kvsieve has compacted it, and its last window queries."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RecentQueries:
    """The last `window` queries of one layer (after RoPE, float32) and their token positions."""

    window: int
    queries: torch.Tensor | None = None  # [q_heads, w, head_dim]
    positions: torch.Tensor | None = None  # [w]

    def append(self, queries: torch.Tensor, positions: torch.Tensor) -> None:
        """Add `queries [n, q_heads, head_dim]` at `positions [n]`, keeping the last `window`."""
        queries, positions = queries[-self.window :].transpose(0, 1).float(), positions[-self.window :]
        if self.queries is not None:
            queries = torch.cat([self.queries, queries], dim=1)[:, -self.window :]
            positions = torch.cat([self.positions, positions])[-self.window :]
        self.queries, self.positions = queries, positions


@dataclass
class HeldCache:
    """One request's cache in a worker: after a compaction, cache indices `[0, C)` hold each (layer, kv-head)'s kept
    entries and every later token at position `p` sits at cache index `p - evicted`.

    Attributes:
        evicted: entries removed from the request's cache index space (`d`); 0 until the first compaction.
        kept: per layer index, `[kv_heads, C]` the positions of the entries at cache indices `[0, C)`.
        recent: per layer index, the last window queries (when the policy reads them).
    """

    evicted: int = 0
    kept: dict[int, torch.Tensor] = field(default_factory=dict)
    recent: dict[int, RecentQueries] = field(default_factory=dict)

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
