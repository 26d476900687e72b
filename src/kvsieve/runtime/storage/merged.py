"""One layer's merged entries (`kvsieve.selection.merge`): per (row, kv-head) a key, a value and a logit bias.

They are kept beside the layer's segments, in the model's dtype whatever the codec stores the entries in,
and never scored or evicted again; sieve attention reads them as one more column (`kernels.merged_sdpa`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...selection.merge import Merged


@dataclass(frozen=True)
class MergedEntries:
    """`keys [rows, kv_heads, d]`, `values [rows, kv_heads, d]` and `bias [rows, kv_heads]` (float32, -inf where a
    (row, kv-head) holds no merged entry)."""

    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor

    @classmethod
    def stacked(
        cls, per_row: Sequence[Merged | None], heads: int, dim: int, dtype: torch.dtype, device: torch.device
    ) -> MergedEntries | None:
        """The merged entries of a batch from each row's (None: a row that merges nothing); None if none holds one."""
        if all(m is None or not bool(torch.isfinite(m.bias).any()) for m in per_row):
            return None
        empty = Merged(torch.zeros(heads, dim), torch.zeros(heads, dim), torch.full((heads,), float("-inf")))
        rows = [empty if m is None else m for m in per_row]
        return cls(
            torch.stack([m.keys.to(device) for m in rows]).to(dtype),
            torch.stack([m.values.to(device) for m in rows]).to(dtype),
            torch.stack([m.bias.to(device) for m in rows]).float(),
        )

    def rows(self, rows: Sequence[int]) -> MergedEntries:
        """The merged entries of the given rows, in that order (repeats allowed)."""
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self.bias.device)
        return MergedEntries(self.keys[index], self.values[index], self.bias[index])

    def row_nbytes(self, row: int) -> int:
        """Bytes of one row's merged keys and values."""
        held = int(torch.isfinite(self.bias[row]).sum())
        return held * (
            self.keys.shape[-1] * self.keys.element_size() + self.values.shape[-1] * self.values.element_size()
        )

    def nbytes(self) -> int:
        return sum(self.row_nbytes(row) for row in range(self.bias.shape[0]))

    def allocated_nbytes(self) -> int:
        """Bytes of the tensors, the slots of (row, kv-head)s that merged nothing included."""
        return sum(t.untyped_storage().nbytes() for t in (self.keys, self.values, self.bias))
