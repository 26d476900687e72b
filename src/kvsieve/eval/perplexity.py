"""Perplexity degradation protocol (DESIGN §4), "prefill once, sieve many".

For each document of `prefix + continuation + 1` tokens: prefill the first `prefix` tokens
once (full cache, observed), then for every (policy, rate) evict from a copy of that cache
and feed the next `continuation` tokens teacher-forced at their true positions. Each fed
token predicts the one after it, so all `continuation` scored tokens are predicted through
the compressed cache. PPL is pooled over every scored token of every document.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..cache import SievedCache
from ..observe import observe_prefill
from ..policy import Policy, check_rate, make_policy
from .stats import bootstrap_delta_ci, pooled_delta_pct, pooled_ppl

#: Called after each (document, configuration) with (done, total).
Progress = Callable[[int, int], None]


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
            "rate_counts": "evicted fraction of evictable entries (sinks and recent window protected)",
            "full_kv_bytes": int(np.mean(self.kv_bytes_full)),
            "documents": self.doc_names,
            "seconds": self.seconds,
            "rows": self.rows(),
        }


@torch.no_grad()
def continuation_nll(model: torch.nn.Module, cache: SievedCache, ids: torch.Tensor) -> float:
    """Sum of NLL of `ids[:, 1:]` when `ids[:, :-1]` is fed after `cache`, teacher-forced."""
    logits = model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True).logits
    return float(F.cross_entropy(logits[0].float(), ids[0, 1:], reduction="sum"))


def per_document_policy(policy: Policy, doc_index: int) -> Policy:
    """Seeded scorers draw fresh randomness for every document."""
    if any(f.name == "seed" for f in dataclasses.fields(policy.scorer)):
        scorer = dataclasses.replace(policy.scorer, seed=policy.scorer.seed * 10_007 + doc_index)
        return dataclasses.replace(policy, scorer=scorer)
    return policy


def run_ppl(
    model: torch.nn.Module,
    documents: Sequence[tuple[str, torch.Tensor]],
    policies: Sequence[str | Policy],
    rates: Sequence[float],
    prefix: int = 1024,
    continuation: int = 512,
    *,
    reprefill: bool = False,
    progress: Progress | None = None,
) -> PplResult:
    """Run the perplexity protocol; `reprefill=True` re-runs the prefill for every configuration (for timing)."""
    resolved = [make_policy(p) for p in policies]
    rates = [check_rate(r) for r in rates]
    observe = {
        "window": max(p.observation_window for p in resolved),
        "accumulate": any(p.needs_accumulated for p in resolved),
    }
    for name, ids in documents:
        if ids.shape[-1] < prefix + continuation + 1:
            raise ValueError(f"document {name!r} has {ids.shape[-1]} tokens, needs {prefix + continuation + 1}")
    names = [p.name for p in resolved]
    if len(set(names)) != len(names):
        raise ValueError(f"policy names must be distinct, got {names}")
    result = PplResult(names, list(rates), prefix, continuation, [name for name, _ in documents])
    timers = {"prefill": 0.0, "evict": 0.0, "continuation": 0.0}

    @contextmanager
    def timed(stage: str) -> Iterator[None]:
        tick = time.perf_counter()
        yield
        timers[stage] += time.perf_counter() - tick

    total = len(documents) * (1 + len(resolved) * len(rates))
    done = 0

    def step() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total)

    start = time.perf_counter()
    for doc_index, (_, ids) in enumerate(documents):
        context, feed = ids[:, :prefix], ids[:, prefix : prefix + continuation + 1]
        with timed("prefill"):
            prefill = observe_prefill(model, context, **observe)
        with timed("continuation"):
            result.nll_full.append(continuation_nll(model, prefill.cache.copy(), feed))
            result.kv_bytes_full.append(prefill.cache.nbytes())
        step()

        for policy in resolved:
            doc_policy = per_document_policy(policy, doc_index)
            for rate in rates:
                if reprefill:
                    with timed("prefill"):
                        prefill = observe_prefill(model, context, **observe)
                with timed("evict"):
                    cache = prefill.cache.keep(doc_policy.keep_indices(prefill.observations, rate))
                with timed("continuation"):
                    result.kv_bytes.setdefault((policy.name, rate), []).append(cache.nbytes())
                    result.nll.setdefault((policy.name, rate), []).append(continuation_nll(model, cache, feed))
                step()
    result.seconds = {**timers, "total": time.perf_counter() - start}
    return result
