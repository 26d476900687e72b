"""Allocators: turn scores and an eviction rate into keep counts per (layer, kv-head), then keep indices."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

#: (scores per layer `[kv_heads, n]`, protected mask per layer `[n]`, rate) -> keep counts of
#: evictable entries per (layer, kv-head).
Allocator = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], float], list[list[int]]]


def evicted_count(n_evictable: int, rate: float) -> int:
    """Entries to evict out of `n_evictable` at eviction rate `rate` (round half up)."""
    return min(n_evictable, math.floor(rate * n_evictable + 0.5))


def uniform(scores: Sequence[torch.Tensor], protected: Sequence[torch.Tensor], rate: float) -> list[list[int]]:
    """Every (layer, kv-head) evicts the same fraction of its evictable entries."""
    counts = []
    for layer_scores, layer_protected in zip(scores, protected, strict=True):
        n_evictable = int((~layer_protected).sum())
        keep = n_evictable - evicted_count(n_evictable, rate)
        counts.append([keep] * layer_scores.shape[0])
    return counts


ALLOCATORS: dict[str, Allocator] = {"uniform": uniform}


def keep_indices(scores: torch.Tensor, protected: torch.Tensor, keep_counts: Sequence[int]) -> list[torch.Tensor]:
    """Sorted indices kept per kv-head: every protected entry plus the `keep_counts[h]` best evictable ones.

    Args:
        scores: `[kv_heads, n]`, higher = keep. protected: `[n]` bool.
    """
    if not torch.isfinite(scores).all():
        raise ValueError("scores must be finite (got NaN or inf)")
    masked = scores.float().masked_fill(protected[None, :], float("-inf"))
    protected_idx = protected.nonzero().flatten()
    out = []
    for h, count in enumerate(keep_counts):
        best = torch.topk(masked[h], k=count, sorted=False).indices if count else protected_idx[:0]
        out.append(torch.cat([protected_idx, best]).sort().values)
    return out
