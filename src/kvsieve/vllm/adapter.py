"""What the plugin needs from one vLLM attention backend's KV cache, and nothing else: the one protocol that separates
the device-free plugin (settings, plans, held state, cells, selection, the scheduler's frees) from a backend.

`kvsieve.vllm.layout.CPUCacheLayout` implements it for vLLM's CPU backend. An adapter for another backend (CUDA's
FlashAttention or FlashInfer) implements the same three methods over its own layout; `docs/vllm.md` says what else
such a backend needs (persistent metadata buffers under CUDA graphs, no host synchronisation in a step).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from .cells import LayerCells


class CacheLayout(Protocol):
    """Reads and writes single cells (one entry of one (layer, kv-head) lane) of a backend's per-layer KV caches."""

    def check(self, layer: torch.nn.Module, kv_cache_dtype: str, kv_cache: torch.Tensor) -> None:
        """A clear error unless this layout reads and writes `layer`'s cache as its kernels do."""
        ...

    def read(
        self, caches: Mapping[int, torch.Tensor], blocks: torch.Tensor, cells: LayerCells
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[*cells.index.shape, head_dim]` at `cells` of a request whose blocks (in cache-index
        order) are `blocks`; `caches` by layer index."""
        ...

    def write(
        self,
        caches: Mapping[int, torch.Tensor],
        blocks: torch.Tensor,
        cells: LayerCells,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Write `keys`, `values` `[*cells.index.shape, head_dim]` at `cells` (padding cells skipped)."""
        ...
