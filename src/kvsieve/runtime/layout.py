"""What sieve attention must know about the key/value tensors a `SievedCache` layer returned.

`SievedLayer.update` returns plain `[rows, kv_heads, length, head_dim]` tensors, as every
`transformers` cache does. When heads hold different entries, those tensors are padded and their
columns are no longer cache positions, so attention needs each entry's cache position too. The
layer publishes a `RaggedLayout` for the key tensor it returned; sieve attention claims it by that
tensor. The table holds tensors weakly, and a layout holds no key or value tensor, so an entry
disappears with its key tensor.

Only sieve attention reads an evicted layer correctly, so a layer refuses to hand one out unless
the running code is inside a sieve-attention scope (`sieve_scope`, entered by
`kvsieve.sieve_attention`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from .segments import Slots


class Recorder(Protocol):
    """Receives what an observed prefill's attention saw, layer by layer (see `kvsieve.observe`)."""

    accumulate: bool
    query_weight: torch.Tensor | None

    def record(
        self,
        layer_idx: int,
        module: torch.nn.Module,
        query: torch.Tensor,
        scaling: float,
        received: torch.Tensor | None,
    ) -> None: ...


class QueryLog(Protocol):
    """Receives every decoding forward's queries, layer by layer (see `kvsieve.growth.RecentQueries`)."""

    def append(self, layer_idx: int, query: torch.Tensor, positions: torch.Tensor) -> None: ...


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
    """

    slots: Slots
    query_positions: torch.Tensor
    contiguous: bool
    layer_idx: int
    recorder: Recorder | None = None
    queries: QueryLog | None = None
    tally: AttentionTally | None = None


_LAYOUTS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def publish(keys: torch.Tensor, layout: RaggedLayout) -> None:
    """Attach `layout` to the key tensor a cache layer returned."""
    _LAYOUTS[keys] = layout


def layout_of(keys: torch.Tensor) -> RaggedLayout | None:
    """The layout published for `keys`, or None for tensors of any other cache."""
    return _LAYOUTS.get(keys)


_SIEVE_SCOPES: ContextVar[int] = ContextVar("kvsieve_sieve_scopes", default=0)


@contextmanager
def sieve_scope() -> Iterator[None]:
    """Mark the block as running on sieve attention."""
    token = _SIEVE_SCOPES.set(_SIEVE_SCOPES.get() + 1)
    try:
        yield
    finally:
        _SIEVE_SCOPES.reset(token)


def in_sieve_scope() -> bool:
    return _SIEVE_SCOPES.get() > 0
