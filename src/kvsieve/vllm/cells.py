"""One pool of cells per request: where each (layer, kv-head) keeps its entries once heads keep different counts.

vLLM gives a request one block table for all layers and kv-heads: block `b` is a cell of `block_size` entries in
every (layer, kv-head) *lane*. When the policy keeps `n[l][h]` entries (merged ones included) in lane `(l, h)`,
the request needs `rows = ceil(sum(n) / lanes)` cache indices of every lane, not `max(n)`: each lane keeps its
first `min(n, rows)` entries at home (cache indices `[0, n)` of its own lane) and a lane that keeps more puts the
rest in the cells other lanes leave empty, of its own layer first. Every entry of the request's compacted part
is then addressed by a cell `(layer, kv-head, cache index)`; entries that come in later go to cache indices
`rows, rows + 1, ...` of their own lane, as in any vLLM request.

When every lane keeps the same count the cells are the identity (every entry at home) and vLLM's own kernel reads
them; otherwise kvsieve's attention gathers them (`kvsieve.vllm.ragged`). Device-free: plain index tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerCells:
    """The cells of one layer's compacted entries, per kv-head padded to the head that holds the most.

    Attributes:
        layer, head, index: `[kv_heads, width]` the lane (layer, kv-head) and cache index each entry sits at.
        count: `[kv_heads]` how many entries each kv-head holds (the rest of its row is padding).
    """

    layer: torch.Tensor
    head: torch.Tensor
    index: torch.Tensor
    count: torch.Tensor

    @property
    def valid(self) -> torch.Tensor:
        """`[kv_heads, width]` which cells hold an entry."""
        return torch.arange(self.index.shape[1]) < self.count[:, None]

    def with_tail(self, layer_idx: int, rows: int, stored: int) -> LayerCells:
        """These cells followed, in every kv-head, by its own lane's cache indices `[rows, stored)` (the entries
        appended since the compaction), each head's entries contiguous from the left."""
        heads, tail = self.count.numel(), stored - rows
        own = torch.arange(heads)[:, None].expand(heads, tail)
        return LayerCells(
            append_tail(self.layer, self.count, torch.full_like(own, layer_idx), 0),
            append_tail(self.head, self.count, own, 0),
            append_tail(self.index, self.count, torch.arange(rows, stored).expand(heads, tail), 0),
            self.count + tail,
        )


def home_cells(layer: int, kv_heads: int, count: int) -> LayerCells:
    """Cache indices `[0, count)` of every kv-head's own lane in `layer`."""
    index = torch.arange(count).expand(kv_heads, count)
    heads = torch.arange(kv_heads)[:, None].expand(kv_heads, count)
    return LayerCells(torch.full_like(index, layer), heads, index, torch.full((kv_heads,), count))


def after_prefix(cells: LayerCells, layer_idx: int, shared: int) -> LayerCells:
    """Cache indices `[0, shared)` of every kv-head's own lane (a shared prefix, read where it is), then `cells`."""
    prefix = home_cells(layer_idx, cells.count.numel(), shared)
    layer, head, index = (
        torch.cat([getattr(prefix, name), getattr(cells, name)], dim=1) for name in ("layer", "head", "index")
    )
    return LayerCells(layer, head, index, cells.count + shared)


def append_tail(compacted: torch.Tensor, count: torch.Tensor, tail: torch.Tensor, fill: float) -> torch.Tensor:
    """`[heads, max(count) + t]`: each head's first `count[h]` of `compacted [heads, w]`, then its row of `tail
    [heads, t]`, then `fill`."""
    heads, t = tail.shape
    width = int(count.max()) + t if heads else t
    out = torch.full((heads, width), fill, dtype=compacted.dtype)
    column = torch.arange(width)
    keep = column < count[:, None]
    out[:, : compacted.shape[1]] = torch.where(keep[:, : compacted.shape[1]], compacted, fill)
    at_tail = (column >= count[:, None]) & (column < count[:, None] + t)
    out[at_tail] = tail.to(out.dtype).reshape(-1)
    return out


@dataclass(frozen=True)
class CellPacking:
    """Where every layer's compacted entries go: `rows` cache indices of every lane, and each layer's cells."""

    rows: int
    layers: tuple[LayerCells, ...]

    @property
    def identity(self) -> bool:
        """Whether every lane holds exactly `rows` entries at home (the layout vLLM's kernel reads)."""
        return all(bool((cells.count == self.rows).all()) for cells in self.layers)


def pack_cells(counts: Sequence[Sequence[int]], start: int = 0) -> CellPacking:
    """The packing of lanes that keep `counts[layer][kv_head]` entries into `ceil(sum / lanes)` cache indices each,
    from cache index `start` on (a shared prefix before it)."""
    num_layers, heads = len(counts), len(counts[0])
    n = torch.tensor(counts, dtype=torch.long)  # [layers, heads]
    rows = -(-int(n.sum()) // n.numel())
    home = n.clamp(max=rows)
    spare = [_spare_cells(home[layer], layer, rows) for layer in range(num_layers)]
    overflow = (n - home).tolist()
    placed: dict[tuple[int, int], list[torch.Tensor]] = {}
    for layer in range(num_layers):  # a layer's own spare cells first, then any layer's
        spare[layer] = _fill(placed, overflow, spare[layer], [layer])
    leftover = torch.cat(spare, dim=0) if spare else torch.empty(0, 3, dtype=torch.long)
    _fill(placed, overflow, leftover, range(num_layers))
    layers = []
    for layer in range(num_layers):
        cells = torch.zeros(3, heads, int(n[layer].max()), dtype=torch.long)
        for head in range(heads):
            kept = int(home[layer, head])
            cells[:, head, :kept] = torch.stack(
                [torch.full((kept,), layer), torch.full((kept,), head), torch.arange(kept)]
            )
            extra = placed.get((layer, head))
            if extra:
                more = torch.cat(extra, dim=0).T  # [3, n - rows]
                cells[:, head, kept : kept + more.shape[1]] = more
        layers.append(LayerCells(cells[0], cells[1], cells[2] + start, n[layer].clone()))
    return CellPacking(rows, tuple(layers))


def _spare_cells(home: torch.Tensor, layer: int, rows: int) -> torch.Tensor:
    """`[k, 3]` (layer, head, cache index) of the cells a layer's lanes leave empty below `rows`."""
    cells = [
        torch.stack([torch.full((rows - used,), layer), torch.full((rows - used,), head), torch.arange(used, rows)], 1)
        for head, used in enumerate(home.tolist())
        if used < rows
    ]
    return torch.cat(cells, dim=0) if cells else torch.empty(0, 3, dtype=torch.long)


def _fill(
    placed: dict[tuple[int, int], list[torch.Tensor]],
    overflow: list[list[int]],
    spare: torch.Tensor,
    layers: Sequence[int] | range,
) -> torch.Tensor:
    """Give the overflow of `layers`' lanes consecutive cells of `spare`; what is left of `spare`."""
    taken = 0
    for layer in layers:
        for head, more in enumerate(overflow[layer]):
            use = min(more, spare.shape[0] - taken)
            if use:
                placed.setdefault((layer, head), []).append(spare[taken : taken + use])
                overflow[layer][head] -= use
                taken += use
    return spare[taken:]
