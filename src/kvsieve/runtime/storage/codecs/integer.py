"""Integer codes (after KIVI, arXiv 2402.02750): `kv_bits` of 8, 4 or 2 per number, a scale and a minimum per group.

Asymmetric min-max quantization in groups of `group` channels, each group's scale and minimum in the
model's dtype; codes are packed `8 // bits` to a byte along the channels. As in KIVI, the newest
`residual` entries of every (row, kv-head) stay in full precision. KIVI quantizes values per token, as
here, but keys per channel (one scale per channel shared by a group of 32 tokens). Measured on the
default model (`benchmarks/kv_quant_layouts.py`): per-token keys are as good or better at 8 and 4 bits,
KIVI's per-channel keys better at 2 bits, where both lose more than evicting to the same bytes does.
Per-token keys never share a scale between entries, so an eviction never re-quantizes anything; they
are what kvsieve stores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ....selection.errors import PolicyError
from ....selection.storage import DEFAULT_GROUP, DEFAULT_RESIDUAL, Storage
from .base import check_group, group_and_residual, residual_extra


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
    lossless: ClassVar[bool] = False

    @classmethod
    def of(cls, storage: Storage, head_dim: int | None = None) -> Quantized:
        """`storage`'s codec: `kv_group` defaults to 32 channels, or the head dimension when that is smaller."""
        if storage.kv_bits == 16:
            raise PolicyError("kv_codec=int stores kv_bits=8, 4 or 2 per number: give kv_bits")
        return cls(storage.kv_bits, *group_and_residual(storage, head_dim))

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
        return residual_extra(self, head_dim, dtype)

    def check(self, head_dim: int) -> None:
        check_group(self.group, head_dim, self.per_byte, f"{self.bits}-bit codes")

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
