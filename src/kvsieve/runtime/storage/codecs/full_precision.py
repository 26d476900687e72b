"""Entries as the model computed them: the buffers are the key and value tensors themselves."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ....selection.storage import Storage


@dataclass(frozen=True)
class FullPrecision:
    """Keys and values as the model computed them (`kv_bits=16`)."""

    lossless = True
    residual = 0

    @classmethod
    def of(cls, storage: Storage, head_dim: int | None = None) -> FullPrecision:
        return FULL_PRECISION

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
