"""One layer's merged entries (`kvsieve.selection.merge`): per (row, kv-head) `m` keys, values and logit biases.

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
    """`keys [rows, kv_heads, m, d]`, `values [rows, kv_heads, m, d]` and `bias [rows, kv_heads, m]` (float32, -inf
    where a (row, kv-head) holds fewer than `m` merged entries)."""

    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor

    @classmethod
    def stacked(
        cls, per_row: Sequence[Merged | None], heads: int, dim: int, dtype: torch.dtype, device: torch.device
    ) -> MergedEntries | None:
        """The merged entries of a batch from each row's (None: a row that merges nothing), as many per (row, kv-head)
        as the row with the most holds (the others' missing ones at bias -inf); None if none holds one."""
        if all(m is None or not bool(torch.isfinite(m.bias).any()) for m in per_row):
            return None
        parts = max(m.bias.shape[-1] for m in per_row if m is not None)
        rows = [_padded(m, heads, parts, dim) for m in per_row]
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


def _padded(merged: Merged | None, heads: int, parts: int, dim: int) -> Merged:
    """`merged` with `parts` entries a kv-head, the added ones (all of them for None) empty: zeros at bias -inf."""
    have = 0 if merged is None else merged.bias.shape[-1]
    device = torch.device("cpu") if merged is None else merged.bias.device
    pad = Merged(
        torch.zeros(heads, parts - have, dim, device=device),
        torch.zeros(heads, parts - have, dim, device=device),
        torch.full((heads, parts - have), float("-inf"), device=device),
    )
    if merged is None:
        return pad
    return Merged(
        *(torch.cat([mine, extra], 1) for mine, extra in zip(vars(merged).values(), vars(pad).values(), strict=True))
    )
