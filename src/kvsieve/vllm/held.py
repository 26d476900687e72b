"""What one request's cache holds in a vLLM worker once kvsieve has compacted it, and what its last window queries
yielded."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .cells import LayerCells, append_tail, home_cells
from .ragged import HeldEntries


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


@dataclass(frozen=True)
class CompactedLayer:
    """Where one layer's compacted entries sit and what they are.

    Attributes:
        cells: each kv-head's entries: the kept ones, then its merged ones.
        positions: `[kv_heads, width]` the token position of each (-1 for a merged entry and for padding).
        bias: `[kv_heads, width]` the logit bias of each (0 for a kept entry), or None when nothing was merged.
    """

    cells: LayerCells
    positions: torch.Tensor
    bias: torch.Tensor | None = None


@dataclass
class HeldCache:
    """One request's cache in a worker. After a compaction, cache indices `[0, rows)` of every (layer, kv-head)
    lane hold the compacted entries, in the cells `compacted` names (`kvsieve.vllm.cells`), and every later token
    at position `p` sits at cache index `p - evicted` of its own lane.

    Attributes:
        evicted: true positions minus cache indices (`seen - rows` at the last compaction); 0 until then.
        rows: cache indices of every lane the compacted entries take.
        ragged: whether kvsieve's attention must read this request (heads keep different counts, or merged
            entries with their biases); False: vLLM's kernel reads it as it reads any request.
        mean: the compacted entries per lane on average (at most `rows`).
        shared: the positions `[0, shared)` (whole blocks) that are, or may become, another request's cached
            prefix: never rewritten, kept whole in every lane (protected), read where they are.
        chunked: whether its prompt is prefilled in several chunks and compacted after each.
        compacted: per layer index, the compacted entries.
        recent: per layer index, what the last window queries yielded (when the policy reads them).
        received: per layer index, `[q_heads, positions]` the attention every position's entry received from every
            query so far (when the policy reads it); an evicted position's is never read again.
    """

    evicted: int = 0
    rows: int = 0
    ragged: bool = False
    mean: float = 0.0
    shared: int = 0
    chunked: bool = False
    compacted: dict[int, CompactedLayer] = field(default_factory=dict)
    recent: dict[int, RecentMeasures] = field(default_factory=dict)
    received: dict[int, torch.Tensor] = field(default_factory=dict)

    def add_received(self, layer_idx: int, entries: HeldEntries, received: torch.Tensor) -> None:
        """Add the attention `entries` (padded per kv-head) received, `[kv_heads, width, group]`, at their positions."""
        kv_heads, width, group = received.shape
        per_query_head = received.permute(0, 2, 1).reshape(kv_heads * group, width)
        positions, real = self._per_query_head(entries, group)
        needed = int(positions.max()) + 1
        held = self.received.get(layer_idx)
        if held is None or held.shape[1] < needed:
            grown = torch.zeros(kv_heads * group, max(needed, 2 * (0 if held is None else held.shape[1])))
            if held is not None:
                grown[:, : held.shape[1]] = held
            held = self.received[layer_idx] = grown
        held.scatter_add_(1, positions, per_query_head.float() * real)

    def received_at(self, layer_idx: int, entries: HeldEntries) -> torch.Tensor:
        """`[q_heads, width]` the attention `entries` received so far (0 for padding)."""
        held = self.received[layer_idx]
        positions, real = self._per_query_head(entries, held.shape[0] // entries.positions.shape[0])
        return held.gather(1, positions) * real

    @staticmethod
    def _per_query_head(entries: HeldEntries, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries' positions per query head (padding at 0) and which of them are real entries."""
        real = entries.positions >= 0
        if entries.valid is not None:
            real &= entries.valid
        positions = entries.positions.clamp(min=0).repeat_interleave(group, dim=0)
        return positions, real.repeat_interleave(group, dim=0).float()

    def mean_stored(self, stored: int) -> float:
        """Entries per lane on average when every lane holds `stored` cache indices: what a size budget counts."""
        return stored if not self.compacted else self.mean + stored - self.rows

    def cells(self, layer_idx: int, kv_heads: int, stored: int) -> LayerCells:
        """The cells of a layer's `stored` entries per lane: the compacted ones, then those appended since."""
        if not self.compacted:
            return home_cells(layer_idx, kv_heads, stored)
        return self.compacted[layer_idx].cells.with_tail(layer_idx, self.rows, stored)

    def positions(self, layer_idx: int, kv_heads: int, stored: int) -> torch.Tensor:
        """`[kv_heads, width]` the token positions of `cells`' entries (-1 for merged entries and padding)."""
        appended = torch.arange(self.rows + self.evicted, stored + self.evicted).expand(kv_heads, -1)
        if not self.compacted:
            return appended
        layer = self.compacted[layer_idx]
        return append_tail(layer.positions, layer.cells.count, appended, -1)

    def bias(self, layer_idx: int, kv_heads: int, stored: int) -> torch.Tensor | None:
        """`[kv_heads, width]` the logit bias of `cells`' entries (0 but for merged ones), or None: no merged one."""
        layer = self.compacted.get(layer_idx)
        if layer is None or layer.bias is None:
            return None
        appended = torch.zeros(kv_heads, stored - self.rows)
        return append_tail(layer.bias, layer.cells.count, appended, float("-inf"))
