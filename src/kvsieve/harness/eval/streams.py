"""Streams: caches that long documents are fed through, chunk by chunk, teacher forced (streaming perplexity).

Every `CacheMethod` opens its own stream (`CacheMethod.stream`): the full cache and kvsieve
policies a `SievedStream` (a `SievedCache`, bounded at the budget for a policy), kvpress presses
a `PressStream` (`kvsieve.harness.compare.kvpress`). `run_stream` feeds any of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from ...runtime.attention.sieve import sieve_attention
from ...runtime.compat import cache_argument
from ...runtime.storage.cache import SievedCache
from ..cache_size import CacheSize


class Stream(Protocol):
    """A cache a batch of documents is fed through: `forward` chunks inside `running()`, `size()` after each."""

    def running(self) -> AbstractContextManager: ...

    def forward(self, chunk_ids: torch.Tensor, start: int) -> torch.Tensor:
        """Logits `[rows, c, vocab]` of a chunk whose first token sits at position `start`."""
        ...

    def size(self) -> CacheSize:
        """What one sequence holds now (the largest row; allocated storage shared out evenly)."""
        ...


class SievedStream:
    """A `SievedCache` fed under sieve attention: a full cache, or one a `BoundedGrowth` holds at its budget."""

    def __init__(self, model: torch.nn.Module, cache: SievedCache) -> None:
        self.model = model
        self.cache = cache

    def running(self) -> AbstractContextManager:
        return sieve_attention(self.model)

    def forward(self, chunk_ids: torch.Tensor, start: int) -> torch.Tensor:
        return self.model(input_ids=chunk_ids, **cache_argument(self.model, self.cache), use_cache=True).logits

    def size(self) -> CacheSize:
        return sieved_size(self.cache)


def sieved_size(cache: SievedCache) -> CacheSize:
    """The largest row of a `SievedCache` (allocated storage shared out evenly over the rows)."""
    rows = range(cache.batch_size)
    return CacheSize(
        max(cache.row_nbytes(r) for r in rows),
        cache.allocated_nbytes() // cache.batch_size,
        max(cache.mean_stored(r) for r in rows),
    )


@dataclass
class StreamTrace:
    """One batch of documents fed through one cache.

    Attributes:
        nll: `[rows, T]`; `nll[:, p]` is the NLL of token `p` given the tokens before it (NaN where
            nothing predicted it: position 0, and past what was fed).
        peak: the most one sequence held after any forward (when a bounded cache is fullest).
        seconds: wall time of the forwards, evictions included.
        tokens: tokens fed, all rows together.
    """

    nll: np.ndarray
    peak: CacheSize
    seconds: float
    tokens: int


#: A forward of one chunk `[rows, c]` whose first token sits at the given position -> logits `[rows, c, vocab]`.
Forward = Callable[[torch.Tensor, int], torch.Tensor]


@torch.no_grad()
def feed_stream(
    ids: torch.Tensor,
    forward: Forward,
    measure: Callable[[], CacheSize],
    chunk: int,
    fed: int | None = None,
) -> StreamTrace:
    """Feed the first `fed` tokens of `ids` (`[rows, T]`, all by default) `chunk` at a time, teacher forced.

    Each chunk's logits score the tokens after it (the last one scores the first token of the next
    chunk); `measure` runs after every forward.
    """
    rows, length = ids.shape
    fed = length if fed is None else min(fed, length)
    nll = np.full((rows, length), np.nan, dtype=np.float64)
    peak, seconds = CacheSize(), 0.0
    for start in range(0, fed, chunk):
        end = min(start + chunk, fed)
        tick_start = time.perf_counter()
        logits = forward(ids[:, start:end], start)
        seconds += time.perf_counter() - tick_start
        targets = ids[:, start + 1 : end + 1]
        scored = F.cross_entropy(
            logits[:, : targets.shape[1]].float().transpose(1, 2), targets.to(logits.device), reduction="none"
        )
        nll[:, start + 1 : start + 1 + targets.shape[1]] = scored.double().cpu().numpy()
        peak = peak.peak(measure())
    return StreamTrace(nll, peak, seconds, rows * fed)


def run_stream(ids: torch.Tensor, stream: Stream, chunk: int, fed: int | None = None) -> StreamTrace:
    """`feed_stream` through `stream`, inside its `running()`."""
    with stream.running():
        return feed_stream(ids, stream.forward, stream.size, chunk, fed)
