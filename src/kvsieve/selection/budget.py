"""Budgets: how many entries one sequence keeps, stated as a rate, an entry count or a byte count.

A budget turns the entries a sequence holds into every (layer, kv-head)'s *uniform share*: how
many of its evictable entries it keeps under a uniform split. Allocators then move shares between
heads and layers (`kvsieve.selection.allocators`), always keeping their sum, so every allocator holds the
same bytes under the same budget.

- `Rate(r)`: evict the fraction `r` of each head's evictable entries (round half up).
- `MaxTokens(m)`: hold `m` entries per (layer, kv-head) on average, protected entries included.
- `MaxBytes(b)`: hold at most `b` bytes of keys and values for the sequence, all layers together.

Budgets are about the layers a policy evicts: the full-attention ones. Sliding-window layers keep
their own window; a byte budget sets their bytes at a full window aside first (`reserve`), a rate
and an entry count leave them out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from .errors import PolicyError

#: The eviction rate `compress` uses when no budget is given.
DEFAULT_RATE = 0.5


def check_rate(rate: float) -> float:
    """Eviction rates live in [0, 1): 1 would evict every evictable entry."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= float(rate) < 1.0:
        raise PolicyError(f"eviction rate must be in [0, 1), got {rate!r}")
    return float(rate)


def evicted_count(n_evictable: int, rate: float) -> int:
    """Entries to evict out of `n_evictable` at eviction rate `rate` (round half up)."""
    return min(n_evictable, math.floor(rate * n_evictable + 0.5))


def uniform_keep(n_evictable: int, rate: float) -> int:
    """Evictable entries one head keeps under a uniform split."""
    return n_evictable - evicted_count(n_evictable, rate)


def check_count(name: str, value: object) -> None:
    """A clear error unless `value` is an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PolicyError(f"{name} must be an integer >= 1, got {value!r}")


class Budget(Protocol):
    """How many entries a sequence keeps: each (layer, kv-head)'s uniform share of its evictable entries."""

    #: whether the budget is a size (entries or bytes), which also bounds a cache that grows
    is_size: ClassVar[bool]

    def shares(
        self, evictable: Sequence[torch.Tensor], protected: Sequence[torch.Tensor], entry_bytes: int
    ) -> list[list[int]]:
        """Per layer, per kv-head: evictable entries kept under a uniform split.

        Args:
            evictable, protected: per layer, `[kv_heads, n]` bool masks of the sequence's entries.
            entry_bytes: bytes of one entry's key and value.
        """
        ...

    def reserve(self, nbytes: int) -> Budget:
        """This budget once layers no policy evicts hold `nbytes` per sequence (only a byte budget changes)."""
        ...


class SizeBudget(Budget, Protocol):
    """A budget that is a size, so it bounds a cache that grows (during generation)."""

    def tokens_per_head(self, heads: int, entry_bytes: int) -> int:
        """Entries per (layer, kv-head) on average, for `heads` (layer, kv-head) pairs of `entry_bytes` entries."""
        ...


@dataclass(frozen=True)
class Rate:
    """Evict the fraction `rate` of every head's evictable entries."""

    rate: float
    is_size: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_rate(self.rate)

    def reserve(self, nbytes: int) -> Rate:
        return self

    def shares(
        self, evictable: Sequence[torch.Tensor], protected: Sequence[torch.Tensor], entry_bytes: int = 0
    ) -> list[list[int]]:
        if self.rate > 0 and not any(bool(masks.any()) for masks in evictable):
            raise PolicyError(
                f"nothing to evict: the sequence has {evictable[0].shape[-1]} tokens and all are protected "
                "(n_sink + n_recent + protected positions); use a longer context or less protection"
            )
        return [[uniform_keep(int(n), self.rate) for n in masks.sum(dim=-1).tolist()] for masks in evictable]


@dataclass(frozen=True)
class MaxTokens:
    """Hold `max_tokens` entries per (layer, kv-head) on average, protected entries included.

    A head's uniform share is what its protected entries leave of `max_tokens` (all of its
    evictable entries when it has fewer; what it cannot use goes to heads that have more, so the
    average holds for an evicted cache whose heads hold different counts); the allocator may move
    shares between heads.
    """

    max_tokens: int
    is_size: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_count("max_tokens", self.max_tokens)

    def tokens_per_head(self, heads: int, entry_bytes: int) -> int:
        """Entries per (layer, kv-head) on average."""
        return self.max_tokens

    def reserve(self, nbytes: int) -> MaxTokens:
        return self

    def shares(
        self, evictable: Sequence[torch.Tensor], protected: Sequence[torch.Tensor], entry_bytes: int = 0
    ) -> list[list[int]]:
        room, share = [], []
        for layer_idx, (masks, kept) in enumerate(zip(evictable, protected, strict=True)):
            n_protected = kept.sum(dim=-1)
            if int(n_protected.max()) > self.max_tokens:
                raise PolicyError(
                    f"max_tokens={self.max_tokens} is smaller than the {int(n_protected.max())} protected entries "
                    f"of a kv-head in layer {layer_idx} (n_sink + n_recent + protected positions); "
                    "raise max_tokens or protect less"
                )
            room.append(masks.sum(dim=-1).tolist())
            share.append((self.max_tokens - n_protected).tolist())
        filled = iter(_fill([n for layer in room for n in layer], [n for layer in share for n in layer]))
        return [[next(filled) for _ in layer] for layer in room]


def _fill(room: list[int], share: list[int]) -> list[int]:
    """Each head's share, at most its `room`; what short heads leave goes to the others, spread evenly."""
    out = [min(r, s) for r, s in zip(room, share, strict=True)]
    left = min(sum(share), sum(room)) - sum(out)
    while left > 0:
        open_heads = [h for h, (n, r) in enumerate(zip(out, room, strict=True)) if n < r]
        each = max(1, left // len(open_heads))
        for h in open_heads:
            extra = min(each, room[h] - out[h], left)
            out[h] += extra
            left -= extra
    return out


@dataclass(frozen=True)
class MaxBytes:
    """Hold at most `max_bytes` of keys and values for the sequence: `MaxTokens` of what fits per (layer, kv-head).

    `reserved`: bytes per sequence set aside before the evictable entries get any: layers no policy
    evicts (sliding-window layers at a full window), and what a quantized cache holds beyond its
    entries' quantized bytes (its full-precision residuals).
    """

    max_bytes: int
    reserved: int = 0
    is_size: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_count("max_bytes", self.max_bytes)

    def reserve(self, nbytes: int) -> MaxBytes:
        return dataclasses.replace(self, reserved=nbytes)

    def tokens_per_head(self, heads: int, entry_bytes: int) -> int:
        """Entries per (layer, kv-head) that fit, for `heads` (layer, kv-head) pairs of `entry_bytes` entries."""
        per_head = max(0, self.max_bytes - self.reserved) // (heads * entry_bytes)
        if per_head < 1 and self.reserved:
            raise PolicyError(
                f"max_bytes={self.max_bytes} does not fit what is set aside first ({self.reserved} bytes per "
                "sequence: sliding-window layers at their window, full-precision residuals of quantized entries) "
                f"plus one entry per full-attention (layer, kv-head) ({heads} heads x {entry_bytes} bytes): "
                f"{self.reserved + heads * entry_bytes} bytes at least"
            )
        if per_head < 1:
            raise PolicyError(
                f"max_bytes={self.max_bytes} is below one entry per (layer, kv-head): "
                f"{heads} heads x {entry_bytes} bytes = {heads * entry_bytes} bytes at least"
            )
        return per_head

    def shares(
        self, evictable: Sequence[torch.Tensor], protected: Sequence[torch.Tensor], entry_bytes: int = 0
    ) -> list[list[int]]:
        heads = sum(masks.shape[0] for masks in evictable)
        return MaxTokens(self.tokens_per_head(heads, entry_bytes)).shares(evictable, protected)


def as_budget(budget: float | Budget) -> Budget:
    """A budget, or an eviction rate as a `Rate`."""
    return Rate(budget) if isinstance(budget, (int, float)) else budget


def make_budget(rate: float | None = None, max_tokens: int | None = None, max_bytes: int | None = None) -> Budget:
    """The one budget given (a rate of `DEFAULT_RATE` when none is), or a clear error when several are."""
    given = [k for k, v in (("rate", rate), ("max_tokens", max_tokens), ("max_bytes", max_bytes)) if v is not None]
    if len(given) > 1:
        raise PolicyError(f"give one budget, not {' and '.join(given)}: a rate, max_tokens or max_bytes")
    if max_tokens is not None:
        return MaxTokens(max_tokens)
    if max_bytes is not None:
        return MaxBytes(max_bytes)
    return Rate(DEFAULT_RATE if rate is None else rate)
