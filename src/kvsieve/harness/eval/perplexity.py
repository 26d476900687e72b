"""Perplexity degradation protocol (docs/protocols.md), "prefill once, sieve many".

For each document of `prefix + continuation + 1` tokens: prefill the first `prefix` tokens
once (full cache, observed), then for every (policy, rate) evict from that prefill and feed the
next `continuation` tokens teacher-forced at their true positions. Each fed token predicts the
one after it, so all `continuation` scored tokens are predicted through the compressed cache.
The configurations of a document are fed as rows of one batch (`rows_per_pass` at a time),
each row a different eviction of the same prefill. PPL is pooled over every scored token of
every document.
"""

from __future__ import annotations

import functools
import operator
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...selection.budget import check_rate
from ...selection.observation import Needs
from ...selection.policy import Policy
from ..progress import ProgressCallback
from ..runners import Runner
from .contenders import contender
from .methods import Case, Configuration, FullCache, build, passes
from .stats import bootstrap_delta_ci, pooled_delta_pct, pooled_ppl

#: Configurations fed together as rows of one batch (one prefill, many evictions).
PPL_ROWS_PER_PASS = 4


@dataclass
class PplResult:
    """Per-document negative log-likelihood sums for the full cache and every (policy, rate)."""

    policies: list[str]
    rates: list[float]
    prefix: int
    continuation: int
    doc_names: list[str]
    nll_full: list[float] = field(default_factory=list)
    nll: dict[tuple[str, float], list[float]] = field(default_factory=dict)
    kv_bytes: dict[tuple[str, float], list[int]] = field(default_factory=dict)
    kv_bytes_full: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def tokens(self) -> np.ndarray:
        return np.full(len(self.nll_full), self.continuation, dtype=np.float64)

    @property
    def full_ppl(self) -> float:
        return pooled_ppl(np.array(self.nll_full), self.tokens)

    def row(self, policy: str, rate: float) -> dict[str, Any]:
        nll = np.array(self.nll[policy, rate])
        full = np.array(self.nll_full)
        lo, hi = bootstrap_delta_ci(nll, full, self.tokens)
        return {
            "policy": policy,
            "rate": rate,
            "ppl": pooled_ppl(nll, self.tokens),
            "delta_pct": pooled_delta_pct(nll, full, self.tokens),
            "ci95": [lo, hi],
            "kv_bytes": int(np.mean(self.kv_bytes[policy, rate])),
        }

    def rows(self) -> list[dict[str, Any]]:
        return [self.row(p, r) for r in self.rates for p in self.policies]

    def to_json(self) -> dict[str, Any]:
        return {
            "full_ppl": self.full_ppl,
            "docs": len(self.nll_full),
            "tokens": int(self.tokens.sum()),
            "prefix": self.prefix,
            "continuation": self.continuation,
            "rate_counts": "evicted fraction of evictable entries (sinks and recent tail protected)",
            "full_kv_bytes": int(np.mean(self.kv_bytes_full)),
            "documents": self.doc_names,
            "seconds": self.seconds,
            "rows": self.rows(),
        }


@dataclass(frozen=True)
class PplDocument:
    """A document of the protocol: its index (the seed of random policies) and ids (`prefix + continuation + 1`)."""

    index: int
    ids: torch.Tensor


@dataclass(frozen=True)
class PplScores:
    """A document through every configuration (in their order): NLL sum and cache bytes each; seconds per stage."""

    nll: list[float]
    kv_bytes: list[int]
    seconds: dict[str, float]


@dataclass(frozen=True)
class PplWork:
    """One document: prefill it once, then evict and feed the continuation, `rows_per_pass` configurations a batch."""

    configurations: list[Configuration]
    needs: Needs
    prefix: int
    continuation: int
    rows_per_pass: int
    reprefill: bool

    def __call__(self, model: torch.nn.Module, tokenizer: Any, document: PplDocument) -> PplScores:
        ids = document.ids.to(model.device)
        case = Case(ids[:, : self.prefix], self.prefix, document.index, self.needs, tokenizer=tokenizer)
        timers = {"prefill": 0.0, "evict": 0.0, "continuation": 0.0}

        @contextmanager
        def timed(stage: str) -> Iterator[None]:
            tick = time.perf_counter()
            yield
            timers[stage] += time.perf_counter() - tick

        scores: dict[tuple[str, float], tuple[float, int]] = {}
        for batch in passes(self.configurations, 1 if self.reprefill else self.rows_per_pass):
            case = case.fresh() if self.reprefill else case
            with timed("prefill"):
                case.prefill(model)
            with timed("evict"):
                compressed = build(model, case, batch)
            with timed("continuation"):
                nll = compressed.continuation_nll(model, ids[:, self.prefix : self.prefix + self.continuation + 1])
            for (method, rate), value, kv_bytes in zip(batch, nll, compressed.kv_bytes, strict=True):
                scores[method.name, rate] = value, kv_bytes
        ordered = [scores[method.name, rate] for method, rate in self.configurations]  # passes group by builder
        return PplScores([nll for nll, _ in ordered], [kv_bytes for _, kv_bytes in ordered], timers)


def run_ppl(
    runner: Runner,
    documents: Sequence[tuple[str, torch.Tensor]],
    policies: Sequence[str | Policy],
    rates: Sequence[float],
    prefix: int = 1024,
    continuation: int = 512,
    *,
    rows_per_pass: int = PPL_ROWS_PER_PASS,
    reprefill: bool = False,
    progress: ProgressCallback | None = None,
) -> PplResult:
    """Run the perplexity protocol, a document per cell of `runner` (`runners.LocalRunner(model)`, or a `RayRunner`).

    Args:
        rows_per_pass: configurations fed together as one batch (1: one at a time).
        reprefill: re-run the prefill for every configuration and feed them one at a time, as a
            library that compresses during the prefill must (for timing; the numbers are the same).
    """
    methods = [contender(p) for p in policies]
    rates = [check_rate(r) for r in rates]
    if rows_per_pass < 1:
        raise ValueError(f"rows_per_pass must be >= 1, got {rows_per_pass}")
    for name, ids in documents:
        if ids.shape[-1] < prefix + continuation + 1:
            raise ValueError(f"document {name!r} has {ids.shape[-1]} tokens, needs {prefix + continuation + 1}")
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise ValueError(f"policy names must be distinct, got {names}")
    needs = functools.reduce(operator.or_, (m.needs for m in methods), Needs())
    result = PplResult(names, list(rates), prefix, continuation, [name for name, _ in documents])
    # in order of rate: a batch is read padded to its widest row, so rows of a batch should be alike
    configurations = [(FullCache(), 0.0), *sorted(((m, r) for m in methods for r in rates), key=lambda c: c[1])]
    work = PplWork(configurations, needs, prefix, continuation, rows_per_pass, reprefill)
    cells = [PplDocument(i, ids.cpu()) for i, (_, ids) in enumerate(documents)]
    timers = {"prefill": 0.0, "evict": 0.0, "continuation": 0.0}
    start, total = time.perf_counter(), len(cells) * len(configurations)
    for done, scores in enumerate(runner.map(work, cells), start=1):
        for (method, rate), value, kv_bytes in zip(configurations, scores.nll, scores.kv_bytes, strict=True):
            if method.is_full:
                result.nll_full.append(value)
                result.kv_bytes_full.append(kv_bytes)
            else:
                result.nll.setdefault((method.name, rate), []).append(value)
                result.kv_bytes.setdefault((method.name, rate), []).append(kv_bytes)
        timers = {stage: timers[stage] + seconds for stage, seconds in scores.seconds.items()}
        if progress:
            progress(done * len(configurations), total)
    result.seconds = {**timers, "total": time.perf_counter() - start}
    return result
