"""Allocators: turn scores and a budget's uniform shares into keep counts per (layer, kv-head) of one sequence.

A budget (`kvsieve.selection.budget`) gives every head its uniform share; every allocator keeps the sum of
the shares and differs only in where the entries go. Counts are of evictable entries
(`evictable [kv_heads, n]` per layer: existing and not protected); protected entries are kept on
top of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch


class Allocator(Protocol):
    """Splits the kept entries over layers and kv-heads."""

    name: ClassVar[str]

    def counts(
        self,
        scores: Sequence[torch.Tensor],
        evictable: Sequence[torch.Tensor],
        shares: Sequence[Sequence[int]],
        calibrated: bool = False,
    ) -> list[list[int]]:
        """Keep counts of evictable entries per (layer, kv-head), from scores and masks `[kv_heads, n]` and the
        uniform shares (counts per head that sum to the budget). `calibrated`: the scores of all layers and
        heads already share one scale (`Scorer.calibrated`)."""
        ...


def apportion(targets: Sequence[float], caps: Sequence[int], total: int) -> list[int]:
    """Integers `0 <= c_i <= caps[i]` summing to `total`, as close to `targets` as possible.

    Targets above their cap are clipped and the excess is spread over the others in
    proportion to their targets; then floors plus largest remainders.
    """
    if total > sum(caps):
        raise ValueError(f"cannot place {total} entries in caps summing to {sum(caps)}")
    share = [min(max(t, 0.0), c) for t, c in zip(targets, caps, strict=True)]
    for _ in range(len(share)):
        deficit = total - sum(share)
        free = [i for i, c in enumerate(caps) if share[i] < c]
        if abs(deficit) < 1e-9 or not free:
            break
        weight = sum(share[i] for i in free)
        for i in free:
            extra = deficit * (share[i] / weight if weight > 0 else 1 / len(free))
            share[i] = min(max(share[i] + extra, 0.0), caps[i])
    counts = [min(math.floor(s), c) for s, c in zip(share, caps, strict=True)]
    order = sorted(range(len(share)), key=lambda i: share[i] - counts[i], reverse=True)
    remaining = total - sum(counts)
    while remaining > 0:
        for i in order:
            if remaining and counts[i] < caps[i]:
                counts[i] += 1
                remaining -= 1
    return counts


def pooled_counts(scores: Sequence[torch.Tensor], floors: Sequence[int], total: int) -> list[int]:
    """Each head keeps its `floors[h]` best entries; the other `total - sum(floors)` go to the best of all heads.

    Args:
        scores: one 1-D tensor of evictable-entry scores per head, on one comparable scale.
    """
    boosted, owner = [], []
    for h, (head_scores, floor) in enumerate(zip(scores, floors, strict=True)):
        head = head_scores.float().clone()
        if floor:
            head[torch.topk(head, floor).indices] = float("inf")
        boosted.append(head)
        owner.append(torch.full_like(head, h, dtype=torch.long))
    chosen = torch.topk(torch.cat(boosted), total).indices
    return torch.bincount(torch.cat(owner)[chosen], minlength=len(scores)).tolist()


def pyramid_budgets(mean: float, num_layers: int, beta: float) -> list[float]:
    """PyramidKV's linear schedule: layer 0 keeps `2 mean - mean / beta`, the last layer `mean / beta`."""
    if num_layers == 1:
        return [mean]
    low = mean / beta
    step = (2 * mean - 2 * low) / (num_layers - 1)
    return [2 * mean - low - layer * step for layer in range(num_layers)]


def mass_share(scores: torch.Tensor) -> torch.Tensor:
    """Each entry's share of its head's score mass (scores shifted to be >= 0 first)."""
    shifted = scores.float() - scores.min().clamp(max=0)
    total = shifted.sum()
    return shifted / total if total > 0 else torch.full_like(shifted, 1.0 / max(1, shifted.numel()))


def zscore(scores: torch.Tensor) -> torch.Tensor:
    """Scores standardised within their head: `(s - mean) / std`."""
    scores = scores.float()
    std = scores.std() if scores.numel() > 1 else scores.new_zeros(())
    return (scores - scores.mean()) / std if std > 0 else torch.zeros_like(scores)


CALIBRATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "mass": mass_share,
    "zscore": zscore,
    "raw": lambda scores: scores.float(),
}
#: Global's default: `raw` for scorers whose scores share one scale (`Scorer.calibrated`), else `mass`.
AUTO_CALIBRATION = "auto"


def _evictable(scores: Sequence[torch.Tensor], evictable: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Per layer, per kv-head: the scores of the evictable entries."""
    return [
        [head[mask] for head, mask in zip(layer, masks, strict=True)]
        for layer, masks in zip(scores, evictable, strict=True)
    ]


def _per_layer(flat: Sequence[int], heads: Sequence[int]) -> list[list[int]]:
    """Split a flat list of per-head counts back into layers of `heads[l]` heads."""
    out, start = [], 0
    for h in heads:
        out.append(list(flat[start : start + h]))
        start += h
    return out


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


@dataclass(frozen=True)
class Uniform:
    """Every (layer, kv-head) evicts the same fraction of its evictable entries."""

    name: ClassVar[str] = "uniform"

    def counts(
        self,
        scores: Sequence[torch.Tensor],
        evictable: Sequence[torch.Tensor],
        shares: Sequence[Sequence[int]],
        calibrated: bool = False,
    ) -> list[list[int]]:
        return [list(layer) for layer in shares]


@dataclass(frozen=True)
class Pyramid:
    """PyramidKV (arXiv 2406.02069): lower layers keep more, on a linear schedule set by `beta`.

    The last layer keeps `1/beta` of the mean budget, the first `2 - 1/beta` of it; a layer's
    budget above its evictable entries is clipped and the excess spread over the others.
    """

    name: ClassVar[str] = "pyramid"
    beta: float = 20.0

    def __post_init__(self) -> None:
        if self.beta < 1:
            raise ValueError(f"beta must be >= 1, got {self.beta}")

    def counts(
        self,
        scores: Sequence[torch.Tensor],
        evictable: Sequence[torch.Tensor],
        shares: Sequence[Sequence[int]],
        calibrated: bool = False,
    ) -> list[list[int]]:
        heads = [s.shape[0] for s in scores]
        total = sum(map(sum, shares))
        budgets = pyramid_budgets(total / sum(heads), len(scores), self.beta)
        targets = [b for b, h in zip(budgets, heads, strict=True) for _ in range(h)]
        caps = [n for masks in evictable for n in masks.sum(dim=-1).tolist()]
        return _per_layer(apportion(targets, caps, total), heads)


@dataclass(frozen=True)
class Adaptive:
    """AdaKV (arXiv 2407.11550): inside each layer, kv-heads compete for the layer's budget by raw score.

    Each head first keeps `safeguard` of its uniform share (its best entries); the rest of the
    layer's budget goes to the best-scoring entries of any head.
    """

    name: ClassVar[str] = "adaptive"
    safeguard: float = 0.2

    def __post_init__(self) -> None:
        _check_fraction("safeguard", self.safeguard)

    def counts(
        self,
        scores: Sequence[torch.Tensor],
        evictable: Sequence[torch.Tensor],
        shares: Sequence[Sequence[int]],
        calibrated: bool = False,
    ) -> list[list[int]]:
        counts = []
        for layer_scores, layer_shares in zip(_evictable(scores, evictable), shares, strict=True):
            floors = [math.floor(self.safeguard * share) for share in layer_shares]
            counts.append(pooled_counts(layer_scores, floors, sum(layer_shares)))
        return counts


@dataclass(frozen=True)
class Global:
    """One pool for all layers and kv-heads: entries compete on calibrated scores.

    Raw scores of different layers are not on one scale, so each head's evictable scores are
    calibrated first: `mass` (the default, unless the scorer's scores already share one scale:
    then `raw`) turns them into the head's share of its score mass
    (for attention scores: the share of attention the entry holds; the pool then keeps the
    entries that retain the most attention summed over heads); `zscore` standardises them
    per head. Each head keeps at least `safeguard` of its uniform share.
    """

    name: ClassVar[str] = "global"
    calibration: str = AUTO_CALIBRATION
    safeguard: float = 0.0

    def __post_init__(self) -> None:
        if self.calibration != AUTO_CALIBRATION and self.calibration not in CALIBRATIONS:
            valid = ", ".join([AUTO_CALIBRATION, *CALIBRATIONS])
            raise ValueError(f"unknown calibration {self.calibration!r}; valid: {valid}")
        _check_fraction("safeguard", self.safeguard)

    def counts(
        self,
        scores: Sequence[torch.Tensor],
        evictable: Sequence[torch.Tensor],
        shares: Sequence[Sequence[int]],
        calibrated: bool = False,
    ) -> list[list[int]]:
        name = self.calibration
        if name == AUTO_CALIBRATION:
            name = "raw" if calibrated else "mass"
        calibrate = CALIBRATIONS[name]
        flat_shares = [share for layer in shares for share in layer]
        flat = [calibrate(s) for layer_scores in _evictable(scores, evictable) for s in layer_scores]
        floors = [math.floor(self.safeguard * share) for share in flat_shares]
        return _per_layer(pooled_counts(flat, floors, sum(flat_shares)), [s.shape[0] for s in scores])


ALLOCATORS: dict[str, type] = {cls.name: cls for cls in (Uniform, Pyramid, Adaptive, Global)}


def top_scored(
    scores: torch.Tensor, protected: torch.Tensor, evictable: torch.Tensor, keep_counts: Sequence[int]
) -> list[torch.Tensor]:
    """Sorted indices kept per kv-head: every protected entry plus the `keep_counts[h]` best evictable ones.

    Equal scores keep the earlier entry, so two engines that compute the same scores keep the same entries.

    Args:
        scores: `[kv_heads, n]`, higher = keep. protected, evictable: `[kv_heads, n]` bool.
    """
    if not torch.isfinite(scores[evictable]).all():
        raise ValueError("scores must be finite (got NaN or inf)")
    masked = scores.float().masked_fill(~evictable, float("-inf"))
    out = []
    for h, count in enumerate(keep_counts):
        best = torch.sort(masked[h], descending=True, stable=True).indices[:count]
        out.append(torch.cat([protected[h].nonzero().flatten(), best]).sort().values)
    return out
