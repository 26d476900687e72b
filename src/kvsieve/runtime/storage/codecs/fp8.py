"""Float8 entries: every key and value in e4m3 (`torch.float8_e4m3fn`), one scale per `group` channels.

The format of `transformers`' ``fp8`` quantized-cache backend and of FP8 KV caches in serving engines
(e4m3, after "FP8 Formats for Deep Learning", arXiv 2209.05433). `transformers` scales a whole layer's
tensor at once; here each entry's groups of channels get their own scale (`absmax / 448`), so an entry
never shares a scale with another and evicting one never re-encodes the rest. The newest `residual`
entries of every (row, kv-head) stay as computed, as for integer codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ....selection.errors import PolicyError
from ....selection.storage import DEFAULT_GROUP, DEFAULT_RESIDUAL, Storage
from .base import check_group, group_and_residual, residual_extra

FORMAT = torch.float8_e4m3fn
#: The largest finite e4m3 number.
LARGEST = torch.finfo(FORMAT).max


@dataclass(frozen=True)
class Float8:
    """Buffers per entry: key codes `[d]` (e4m3 bytes, as uint8), key scales `[d / group]` in the model's dtype,
    and the same for the value."""

    group: int = DEFAULT_GROUP
    residual: int = DEFAULT_RESIDUAL
    lossless: ClassVar[bool] = False

    def __post_init__(self) -> None:
        Storage(8, self.group, self.residual, "fp8")  # checks the numbers

    @classmethod
    def of(cls, storage: Storage, head_dim: int | None = None) -> Float8:
        """`storage`'s codec (``kv_codec=fp8``): 8 bits a number, so `kv_bits` is 8 or not given."""
        if storage.kv_bits not in (8, 16):
            raise PolicyError(f"kv_codec=fp8 stores 8 bits a number, not kv_bits={storage.kv_bits}: leave kv_bits out")
        return cls(*group_and_residual(storage, head_dim))

    def entry_bytes(self, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * (head_dim + (head_dim // self.group) * dtype.itemsize)

    def residual_bytes(self, head_dim: int, dtype: torch.dtype) -> int:
        return residual_extra(self, head_dim, dtype)

    def check(self, head_dim: int) -> None:
        check_group(self.group, head_dim)

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (*self._quantize(keys), *self._quantize(values))

    def decode(self, buffers: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key_codes, key_scales, value_codes, value_scales = buffers
        return self._dequantize(key_codes, key_scales, dtype), self._dequantize(value_codes, value_scales, dtype)

    def _quantize(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes `[..., d]` (e4m3 bytes) and scales `[..., d / group]` in the states' dtype."""
        groups = states.float().unflatten(-1, (-1, self.group))
        scale = (groups.abs().amax(dim=-1) / LARGEST).to(states.dtype)
        step = torch.where(scale == 0, 1.0, scale.float())
        codes = (groups / step[..., None]).clamp_(-LARGEST, LARGEST).to(FORMAT)  # the rounded scale may overshoot
        return codes.flatten(-2).view(torch.uint8), scale

    def _dequantize(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        groups = codes.view(FORMAT).float().unflatten(-1, (-1, self.group))
        return (groups * scales.float()[..., None]).flatten(-2).to(dtype)
