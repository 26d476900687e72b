"""How a cache layer stores each entry: the codec contract (`base`), one file per codec, and `CODECS` by name.

A policy's storage names its codec (`Storage.codec_name`: ``full``, ``int`` when `kv_bits` < 16, or
`kv_codec`); a new codec is one file whose class has an `of(storage, head_dim)` constructor, and one
line in `CODECS`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ....modeling.architecture import kv_geometry
from ....selection.errors import PolicyError
from ....selection.observation import Observation
from ....selection.storage import Storage
from ...inputs import check_model
from .base import EntryCodec
from .fp8 import Float8
from .full_precision import FULL_PRECISION, FullPrecision
from .integer import Quantized

#: Every codec by the name a storage gives (`Storage.codec_name`), as a constructor from the storage and the
#: head dimension (None when not known yet).
CODECS: dict[str, Callable[[Storage, int | None], EntryCodec]] = {
    "full": FullPrecision.of,
    "int": Quantized.of,
    "fp8": Float8.of,
}


def codec_for(storage: Storage, head_dim: int | None = None) -> EntryCodec:
    """The codec that stores entries as `storage` says; with `head_dim`, checked against it (a clear error)."""
    name = storage.codec_name
    if name not in CODECS or storage.kv_codec == "full":  # full precision is what no storage key says
        raise PolicyError(f"kv_codec={name!r} is not a codec; known: {', '.join(c for c in CODECS if c != 'full')}")
    codec = CODECS[name](storage, head_dim)
    if head_dim is not None:
        codec.check(head_dim)
    return codec


def make_codec(
    kv_bits: int = 16, kv_group: int | None = None, head_dim: int | None = None, kv_residual: int | None = None
) -> EntryCodec:
    """The integer codec for `kv_bits` (16: full precision), as `codec_for` makes it."""
    return codec_for(Storage(kv_bits, kv_group, kv_residual), head_dim)


def storage_codec(storage: Storage, model: torch.nn.Module) -> EntryCodec:
    """The codec that stores `model`'s entries as `storage` says (checked against its head dimension)."""
    check_model(model)
    return codec_for(storage, kv_geometry(model)[1])


def stored_entry_bytes(codec: EntryCodec, observations: Sequence[Observation]) -> int | None:
    """Bytes `codec` stores one of the observed entries in (None when no layer is observed)."""
    if not observations:
        return None
    keys = observations[0].keys
    return codec.entry_bytes(keys.shape[-1], keys.dtype)


def residual_nbytes(codec: EntryCodec, observations: Sequence[Observation]) -> int:
    """Bytes one sequence's observed layers hold beyond `entry_bytes` per entry, stored by `codec` (its residuals)."""
    return sum(o.num_kv_heads * codec.residual_bytes(o.keys.shape[-1], o.keys.dtype) for o in observations)


__all__ = [
    "CODECS",
    "FULL_PRECISION",
    "EntryCodec",
    "Float8",
    "FullPrecision",
    "Quantized",
    "codec_for",
    "make_codec",
    "residual_nbytes",
    "storage_codec",
    "stored_entry_bytes",
]
