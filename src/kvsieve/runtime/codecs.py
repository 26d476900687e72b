"""How a cache layer stores each entry's key and value: in the model's dtype, or quantized to fewer bits.

A codec turns an entry's key and value into *row-aligned* buffers, one row per entry, which
`Segments` moves, gathers and evicts as rows; nothing is shared between entries, so evicting an
entry frees its bytes and never re-quantizes another.

`Quantized` (after KIVI, arXiv 2402.02750): asymmetric min-max quantization to `bits` bits per
number in groups of `group` channels, with each group's scale and minimum in the model's dtype;
codes are packed `8 // bits` to a byte along the channels. KIVI quantizes values per token, as here,
but keys per channel (one scale per channel shared by a group of 32 tokens, the newest tokens held
in full precision until their group fills). Measured on the default model
(`benchmarks/kv_quant_layouts.py`): per-token keys are better at 8 and 4 bits and KIVI's per-channel
keys at 2 bits, where both lose more than evicting to the same bytes does. Per-token keys need no
full-precision residual and no regrouping after an eviction, so they are what kvsieve stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..selection.architecture import kv_geometry
from ..selection.errors import PolicyError
from ..selection.observation import Observation
from .inputs import check_model

#: Bits per number a quantized cache may store; 16 means the model's own dtype (no quantization).
KV_BITS = (2, 4, 8, 16)
#: Channels that share one scale and minimum, unless the head dimension is smaller.
DEFAULT_GROUP = 32


class EntryCodec(Protocol):
    """Stores keys `[..., d]` and values `[..., dv]` as row-aligned buffers `[..., width]`, and reads them back."""

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]: ...

    def decode(self, buffers: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]: ...

    def entry_bytes(self, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one entry (key and value of `head_dim` channels each, computed in `dtype`) is stored in."""
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

    def check(self, head_dim: int) -> None:
        return None


FULL_PRECISION = FullPrecision()


@dataclass(frozen=True)
class Quantized:
    """Every key and value quantized on its own: `bits` per number, one scale and minimum per `group` channels.

    Buffers per entry: key codes `[d * bits / 8]` uint8, key scale and minimum `[2 * d / group]`, and
    the same for the value; scale and minimum are in the model's dtype.
    """

    bits: int
    group: int = DEFAULT_GROUP

    def __post_init__(self) -> None:
        if self.bits not in KV_BITS[:-1]:
            raise PolicyError(f"kv_bits={self.bits} is not supported; use one of {', '.join(map(str, KV_BITS))}")
        if not isinstance(self.group, int) or self.group < 1:
            raise PolicyError(f"kv_group must be a whole number >= 1, got {self.group!r}")

    @property
    def per_byte(self) -> int:
        return 8 // self.bits

    def entry_bytes(self, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * (head_dim * self.bits // 8 + 2 * (head_dim // self.group) * dtype.itemsize)

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


def codec_for(model: torch.nn.Module, kv_bits: int = 16, kv_group: int | None = None) -> EntryCodec:
    """`make_codec` checked against the model's head dimension (a clear error before any work)."""
    check_model(model)
    return make_codec(kv_bits, kv_group, kv_geometry(model)[1])


def make_codec(kv_bits: int = 16, kv_group: int | None = None, head_dim: int | None = None) -> EntryCodec:
    """The codec for `kv_bits` (16: full precision); `kv_group` defaults to 32 channels, or the head dimension
    when that is smaller. With `head_dim`, checked against it (a clear error names the problem)."""
    if kv_bits == 16:
        if kv_group is not None:
            raise PolicyError("kv_group applies to quantized entries: give it with kv_bits=8, 4 or 2")
        return FULL_PRECISION
    group = kv_group if kv_group is not None else min(DEFAULT_GROUP, head_dim or DEFAULT_GROUP)
    codec = Quantized(kv_bits, group)
    if head_dim is not None:
        codec.check(head_dim)
    return codec
