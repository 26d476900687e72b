"""The codec contract: how a cache layer stores each entry's key and value as row-aligned buffers.

A codec turns an entry's key and value into *row-aligned* buffers, one row per entry, which
`Segments` moves, gathers and evicts as rows; nothing is shared between entries, so evicting an
entry frees its bytes and never re-encodes another. A lossy codec keeps the newest `residual`
entries of every (row, kv-head) as computed (`kvsieve.runtime.storage.quantized_segments`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ....selection.errors import PolicyError
from ....selection.storage import DEFAULT_GROUP, DEFAULT_RESIDUAL, Storage


class EntryCodec(Protocol):
    """Stores keys `[..., d]` and values `[..., dv]` as row-aligned buffers `[..., width]`, and reads them back."""

    #: whether reading back gives the entries exactly as computed (the buffers are the tensors themselves)
    lossless: bool
    #: the newest entries of every (row, kv-head) kept as computed (0 for a lossless codec)
    residual: int

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]: ...

    def decode(self, buffers: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]: ...

    def entry_bytes(self, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one entry (key and value of `head_dim` channels each, computed in `dtype`) is stored in."""
        ...

    def residual_bytes(self, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes a (row, kv-head) holds beyond `entry_bytes` per entry: its full-precision residual's extra."""
        ...

    def check(self, head_dim: int) -> None:
        """A clear error if this codec cannot store heads of `head_dim` channels."""
        ...


def group_and_residual(storage: Storage, head_dim: int | None) -> tuple[int, int]:
    """`storage`'s channels per scale (default 32, or the head dimension when that is smaller) and residual (32)."""
    group = storage.kv_group if storage.kv_group is not None else min(DEFAULT_GROUP, head_dim or DEFAULT_GROUP)
    return group, DEFAULT_RESIDUAL if storage.kv_residual is None else storage.kv_residual


def residual_extra(codec: EntryCodec, head_dim: int, dtype: torch.dtype) -> int:
    """What `codec.residual` entries kept as computed cost beyond storing them encoded (a lossy codec's
    `residual_bytes`)."""
    return codec.residual * (2 * head_dim * dtype.itemsize - codec.entry_bytes(head_dim, dtype))


def check_group(group: int, head_dim: int, multiple: int = 1, what: str = "") -> None:
    """A clear error unless `group` channels (sharing one scale) divide `head_dim` and are a multiple of `multiple`."""
    if head_dim % group:
        raise PolicyError(
            f"kv_group={group} does not divide the head dimension {head_dim}: a group of channels shares "
            f"one scale; use a divisor of {head_dim}"
        )
    if group % multiple:
        raise PolicyError(f"kv_group={group} must be a multiple of {multiple} for {what}")
