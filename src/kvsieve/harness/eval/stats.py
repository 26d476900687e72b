"""Pooled perplexity change and its bootstrap interval over documents."""

from __future__ import annotations

import math

import numpy as np


def pooled_ppl(nll: np.ndarray, tokens: np.ndarray) -> float:
    """Perplexity pooled over every scored token of every document."""
    return math.exp(float(np.sum(nll)) / float(np.sum(tokens)))


def pooled_delta_pct(nll: np.ndarray, nll_full: np.ndarray, tokens: np.ndarray) -> float:
    """`100 * (PPL_r / PPL_full - 1)` with both perplexities pooled over all scored tokens."""
    return 100.0 * (math.exp((float(np.sum(nll)) - float(np.sum(nll_full))) / float(np.sum(tokens))) - 1.0)


def bootstrap_delta_ci(
    nll: np.ndarray,
    nll_full: np.ndarray,
    tokens: np.ndarray,
    n_boot: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """95% percentile interval of `pooled_delta_pct`, resampling documents (paired) with replacement."""
    nll, nll_full, tokens = (np.asarray(a, dtype=np.float64) for a in (nll, nll_full, tokens))
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(nll), size=(n_boot, len(nll)))
    diff = (nll[picks].sum(1) - nll_full[picks].sum(1)) / tokens[picks].sum(1)
    deltas = 100.0 * (np.exp(diff) - 1.0)
    lo, hi = np.percentile(deltas, [2.5, 97.5])
    return float(lo), float(hi)


def bootstrap_mean_ci(values: np.ndarray, n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean, resampling the values (e.g. paired per-sample differences)."""
    values = np.asarray(values, dtype=np.float64)
    picks = np.random.default_rng(seed).integers(0, len(values), size=(n_boot, len(values)))
    lo, hi = np.percentile(values[picks].mean(1), [2.5, 97.5])
    return float(lo), float(hi)


def bootstrap_ppl_ci(nll: np.ndarray, tokens: np.ndarray, n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of `pooled_ppl`, resampling documents with replacement."""
    nll, tokens = (np.asarray(a, dtype=np.float64) for a in (nll, tokens))
    picks = np.random.default_rng(seed).integers(0, len(nll), size=(n_boot, len(nll)))
    ppls = np.exp(nll[picks].sum(1) / tokens[picks].sum(1))
    lo, hi = np.percentile(ppls, [2.5, 97.5])
    return float(lo), float(hi)
