"""The cache layer of a sliding-window attention layer: a rolling window that no policy evicts.

Models such as Gemma-3 mix full-attention layers with sliding-window layers (`config.layer_types`);
Mistral with `sliding_window` set makes every layer a sliding one. A sliding layer's attention
only ever sees the last `sliding_window` tokens, so its cache is already bounded and no policy
evicts from it: `SlidingLayer` is `transformers`' own `DynamicSlidingWindowLayer` (it keeps the
last `sliding_window - 1` tokens between forwards; the next token completes the window, and the
mask `transformers` builds from `get_mask_sizes` hides the rest), plus what `SievedCache` asks of
every layer: stored lengths and positions, bytes, and a copy of chosen rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from ...selection.observation import entry_bytes


class SlidingLayer(DynamicSlidingWindowLayer):
    """One sliding-window layer of a `SievedCache`: the last `sliding_window - 1` tokens of every row, never evicted.

    Its tensors are plain `[rows, kv_heads, n, head_dim]` tensors whose columns are consecutive
    cache positions, so every attention function reads them with `transformers`' sliding mask.
    """

    contiguous = True  # no ragged layout: sieve attention hands these tensors to SDPA unchanged

    @property
    def window_entries(self) -> int:
        """Entries per (row, kv-head) the layer holds between forwards once it has seen a whole window."""
        return self.sliding_window - 1

    @property
    def filled(self) -> bool:
        return self.is_initialized and self.keys.numel() > 0

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0] if self.filled else 0

    def stored_lengths(self, row: int = 0) -> list[int]:
        """Entries stored per kv-head of `row` (every row and head holds the same window)."""
        if not self.filled:
            return []
        return [self.keys.shape[-2]] * self.keys.shape[1]

    def kept_positions(self, row: int = 0) -> list[torch.Tensor]:
        """Cache positions of the entries stored per kv-head of `row`: the last ones seen."""
        if not self.filled:
            return []
        stored = self.keys.shape[-2]
        positions = torch.arange(self.cumulative_length - stored, self.cumulative_length, device=self.device)
        return [positions.clone() for _ in range(self.keys.shape[1])]

    def entry_bytes(self) -> int:
        """Bytes of one stored entry's key and value."""
        return entry_bytes(self.keys, self.values)

    def nbytes(self) -> int:
        """Bytes of the stored keys and values."""
        if not self.filled:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def row_nbytes(self, row: int) -> int:
        """Bytes of one row's keys and values (every row holds the same window)."""
        return self.nbytes() // self.batch_size if self.filled else 0

    def allocated_nbytes(self) -> int:
        """Bytes of the storage the keys and values keep alive (after a forward: the window plus its new tokens)."""
        if not self.filled:
            return 0
        return self.keys.untyped_storage().nbytes() + self.values.untyped_storage().nbytes()

    def window_nbytes(self) -> int:
        """Bytes one row holds once the window is full: what a byte budget sets aside for this layer."""
        return self.keys.shape[1] * self.window_entries * self.entry_bytes() if self.filled else 0

    def select(self, rows: Sequence[int]) -> SlidingLayer:
        """A new layer holding copies of the given rows, in order (repeats allowed)."""
        rows = list(rows)
        if any(not 0 <= row < self.batch_size for row in rows):
            raise IndexError(f"rows {rows} are out of range for a cache of {self.batch_size} sequence(s)")
        out = SlidingLayer(self.sliding_window)
        out.cumulative_length = self.cumulative_length
        if self.filled:
            out.lazy_initialization(self.keys, self.values)
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            out.keys, out.values = self.keys.index_select(0, index), self.values.index_select(0, index)
        return out

    def reset(self) -> None:
        self.__init__(self.sliding_window)
