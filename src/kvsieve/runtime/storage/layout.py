"""What sieve attention must know about the key/value tensors a `SievedCache` layer returned.

`SievedLayer.update` returns plain `[rows, kv_heads, length, head_dim]` tensors, as every
`transformers` cache does. When heads hold different entries, those tensors are padded and their
columns are no longer cache positions, so attention needs each entry's cache position too.
`transformers`' attention interface hands the attention function tensors only, so the cache
publishes a `RaggedLayout` for the key tensor it returned in the active `SieveScope` (the block
`kvsieve.sieve_attention` opened), and sieve attention looks it up there by that tensor.

Only sieve attention reads an evicted layer correctly, so a layer refuses to hand one out
outside a sieve-attention block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from .merged import MergedEntries
from .segments import Slots


class Recorder(Protocol):
    """Runs one layer's attention of an observed forward and keeps what it saw (`kvsieve.runtime.observing.prefill`,
    `kvsieve.runtime.observing.reconstruction`)."""

    def attend(
        self,
        layout: RaggedLayout,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float,
    ) -> torch.Tensor:
        """The attention output `[batch, q, heads, d]` (`transformers`' layout) of `query [batch, heads, q, d]`."""
        ...


class QueryLog(Protocol):
    """Receives every forward's queries and their outputs, layer by layer (see `eviction.growth.RecentWindow`)."""

    def append(self, layer_idx: int, query: torch.Tensor, output: torch.Tensor, positions: torch.Tensor) -> None:
        """`query [rows, q_heads, q, d]`, its attention `output [rows, q_heads, q, dv]`, cache `positions [q]`."""
        ...


class AttentionTally(Protocol):
    """Receives the attention every returned entry got in a forward (see `Segments.add_received`)."""

    def add_received(self, received: torch.Tensor) -> None:
        """`received`: `[rows, kv_heads, length, group]`, laid out as the returned key tensor."""
        ...


@dataclass
class RaggedLayout:
    """The structure of one layer's returned key/value tensors.

    Attributes:
        slots: which columns of the tensors hold entries, and at which cache positions.
        query_positions: `[q]` cache positions of the tokens of the current forward.
        contiguous: every (row, kv-head) holds exactly the cache positions `0 .. length - 1`
            (nothing was evicted), so the columns *are* the cache positions and any attention
            function reads the tensors correctly.
        layer_idx: the layer.
        recorder: set during an observed prefill.
        queries: set on a cache that keeps recent queries for eviction during generation.
        tally: set on a cache that sums the attention each entry receives (H2O during generation).
        merged: the layer's merged entries (`kvsieve.selection.merge`), one more column for every query.
    """

    slots: Slots
    query_positions: torch.Tensor
    contiguous: bool
    layer_idx: int
    recorder: Recorder | None = None
    queries: QueryLog | None = None
    tally: AttentionTally | None = None
    merged: MergedEntries | None = None


class SieveScope:
    """One `kvsieve.sieve_attention` block: the layouts cache layers published in it, by returned key tensor.

    The table holds the tensors weakly and a layout holds none, so an entry goes with its key
    tensor; the table goes with the block.
    """

    def __init__(self) -> None:
        self.layouts: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

    def publish(self, keys: torch.Tensor, layout: RaggedLayout) -> None:
        """Attach `layout` to the key tensor a cache layer returned."""
        self.layouts[keys] = layout

    def layout_of(self, keys: torch.Tensor) -> RaggedLayout | None:
        """The layout published for `keys`, or None for tensors of any other cache."""
        return self.layouts.get(keys)


_SCOPE: ContextVar[SieveScope | None] = ContextVar("kvsieve_sieve_scope", default=None)


@contextmanager
def sieve_scope() -> Iterator[SieveScope]:
    """Mark the block as running on sieve attention; a block inside another shares the outer one's scope."""
    token = _SCOPE.set(_SCOPE.get() or SieveScope())
    try:
        yield _SCOPE.get()
    finally:
        _SCOPE.reset(token)


def active_scope() -> SieveScope | None:
    """The sieve-attention block the running code is in, or None outside every one."""
    return _SCOPE.get()
