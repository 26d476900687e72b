"""How a cache layer stores each entry's key and value: in the model's dtype, or quantized to fewer bits.

A codec turns an entry's key and value into *row-aligned* buffers, one row per entry, which
`Segments` moves, gathers and evicts as rows; nothing is shared between entries, so evicting an
entry frees its bytes and never re-quantizes another.

`Quantized` (after KIVI, arXiv 2402.02750): asymmetric min-max quantization to `bits` bits per
number in groups of `group` channels, with each group's scale and minimum in the model's dtype;
codes are packed `8 // bits` to a byte along the channels. As in KIVI, the newest `residual` entries
of every (row, kv-head) stay in full precision (`kvsieve.runtime.quantized_segments`). KIVI
quantizes values per token, as here, but keys per channel (one scale per channel shared by a group
of 32 tokens). Measured on the default model (`benchmarks/kv_quant_layouts.py`): per-token keys are
as good or better at 8 and 4 bits, KIVI's per-channel keys better at 2 bits, where both lose more
than evicting to the same bytes does. Per-token keys never share a scale between entries, so an
eviction never re-quantizes anything; they are what kvsieve stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..selection.architecture import kv_geometry
from ..selection.errors import PolicyError
from ..selection.observation import Observation
from ..selection.storage import DEFAULT_GROUP, DEFAULT_RESIDUAL, Storage
from .inputs import check_model


class EntryCodec(Protocol):
    """Stores keys `[..., d]` and values `[..., dv]` as row-aligned buffers `[..., width]`, and reads them back."""

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


@dataclass(frozen=True)
class FullPrecision:
    """Keys and values as the model computed them (`kv_bits=16`): the buffers are the tensors themselves."""

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return keys, values

    def decode(self, buffers: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return buffers[0], buffers[1]

    def entry_bytes(self, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * head_dim * dtype.itemsize

    def residual_bytes(self, head_dim: int, dtype: torch.dtype) -> int:
        return 0

    def check(self, head_dim: int) -> None:
        return None


FULL_PRECISION = FullPrecision()


@dataclass(frozen=True)
class Quantized:
    """Every key and value quantized on its own: `bits` per number, one scale and minimum per `group` channels.

    Buffers per entry: key codes `[d * bits / 8]` uint8, key scale and minimum `[2 * d / group]`, and
    the same for the value; scale and minimum are in the model's dtype. The newest `residual` entries of
    every (row, kv-head) are kept in full precision.
    """

    bits: int
    group: int = DEFAULT_GROUP
    residual: int = DEFAULT_RESIDUAL

    def __post_init__(self) -> None:
        if self.bits == 16:
            raise PolicyError("16 bits is the model's own dtype: FULL_PRECISION stores it, not Quantized")
        Storage(self.bits, self.group, self.residual)  # checks the numbers

    @property
    def per_byte(self) -> int:
        return 8 // self.bits

    def entry_bytes(self, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * (head_dim * self.bits // 8 + 2 * (head_dim // self.group) * dtype.itemsize)

    def residual_bytes(self, head_dim: int, dtype: torch.dtype) -> int:
        return self.residual * (FULL_PRECISION.entry_bytes(head_dim, dtype) - self.entry_bytes(head_dim, dtype))

    def check(self, head_dim: int) -> None:
        if head_dim % self.group:
            raise PolicyError(
                f"kv_group={self.group} does not divide the head dimension {head_dim}: a group of channels shares "
                f"one scale; use a divisor of {head_dim}"
            )
        if self.group % self.per_byte:
            raise PolicyError(f"kv_group={self.group} must be a multiple of {self.per_byte} for {self.bits}-bit codes")

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (*self._quantize(keys), *self._quantize(values))

    def decode(self, buffers: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key_codes, key_params, value_codes, value_params = buffers
        return self._dequantize(key_codes, key_params, dtype), self._dequantize(value_codes, value_params, dtype)

    def _quantize(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes `[..., d * bits / 8]` uint8 and params `[..., 2 * d / group]` (scales, then minima)."""
        groups = states.float().unflatten(-1, (-1, self.group))
        low = groups.amin(dim=-1).to(states.dtype)
        scale = ((groups.amax(dim=-1) - low.float()) / (2**self.bits - 1)).to(states.dtype)
        step = torch.where(scale == 0, 1.0, scale.float())
        codes = ((groups - low.float()[..., None]) / step[..., None]).round_().clamp_(0, 2**self.bits - 1)
        return self._pack(codes.to(torch.uint8).flatten(-2)), torch.cat([scale, low], dim=-1)

    def _dequantize(self, codes: torch.Tensor, params: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        scale, low = params.float().chunk(2, dim=-1)
        groups = self._unpack(codes).float().unflatten(-1, (-1, self.group))
        return (groups * scale[..., None] + low[..., None]).flatten(-2).to(dtype)

    def _shifts(self, device: torch.device) -> torch.Tensor:
        return torch.arange(0, 8, self.bits, dtype=torch.uint8, device=device)

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return codes
        spread = codes.unflatten(-1, (-1, self.per_byte)) << self._shifts(codes.device)
        return spread.sum(dim=-1, dtype=torch.uint8)  # the codes occupy disjoint bits: the sum is their OR

    def _unpack(self, packed: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return packed
        return ((packed[..., None] >> self._shifts(packed.device)) & (2**self.bits - 1)).flatten(-2)


def stored_entry_bytes(codec: EntryCodec, observations: Sequence[Observation]) -> int | None:
    """Bytes `codec` stores one of the observed entries in (None when no layer is observed)."""
    if not observations:
        return None
    keys = observations[0].keys
    return codec.entry_bytes(keys.shape[-1], keys.dtype)


def residual_nbytes(codec: EntryCodec, observations: Sequence[Observation]) -> int:
    """Bytes one sequence's observed layers hold beyond `entry_bytes` per entry, stored by `codec` (its residuals)."""
    return sum(o.num_kv_heads * codec.residual_bytes(o.keys.shape[-1], o.keys.dtype) for o in observations)


def make_codec(
    kv_bits: int = 16, kv_group: int | None = None, head_dim: int | None = None, kv_residual: int | None = None
) -> EntryCodec:
    """The codec for `kv_bits` (16: full precision); `kv_group` defaults to 32 channels, or the head dimension
    when that is smaller, `kv_residual` to 32 entries. With `head_dim`, checked against it (a clear error
    names the problem)."""
    Storage(kv_bits, kv_group, kv_residual)  # checks the numbers
    if kv_bits == 16:
        return FULL_PRECISION
    group = kv_group if kv_group is not None else min(DEFAULT_GROUP, head_dim or DEFAULT_GROUP)
    codec = Quantized(kv_bits, group, DEFAULT_RESIDUAL if kv_residual is None else kv_residual)
    if head_dim is not None:
        codec.check(head_dim)
    return codec


def storage_codec(storage: Storage, model: torch.nn.Module) -> EntryCodec:
    """The codec that stores `model`'s entries as `storage` says (a clear error when the group does not fit its
    head dimension)."""
    check_model(model)
    return make_codec(storage.kv_bits, storage.kv_group, kv_geometry(model)[1], storage.kv_residual)
