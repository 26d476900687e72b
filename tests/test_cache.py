"""SievedCache bookkeeping: kept counts, protection, reproducibility, bytes, release of evicted tensors."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import kvsieve
from kvsieve.allocators import evicted_count
from kvsieve.scorers import SCORERS


@pytest.mark.parametrize("policy", list(SCORERS))
@pytest.mark.parametrize("rate", [0.0, 0.3, 0.8])
def test_kept_counts_and_protection(model, ids, policy, rate):
    n_sink, window = 4, 16
    cache = kvsieve.compress(model, ids, policy, rate, n_sink=n_sink, sliding_window=window)
    n_evictable = 120 - n_sink - window
    expected = 120 - evicted_count(n_evictable, rate)
    assert cache.stored_lengths() == [[expected, expected]] * 3
    protected = set(range(n_sink)) | set(range(120 - window, 120))
    for layer in range(3):
        for positions in cache.kept_positions(layer):
            assert protected <= set(positions.tolist())
            assert torch.equal(positions, positions.sort().values)
            assert len(set(positions.tolist())) == len(positions)


def test_caller_protected_positions_are_kept(model, ids):
    question = torch.arange(40, 50)
    cache = kvsieve.compress(model, ids, "random", 0.9, protect_positions=question)
    for layer in range(3):
        for positions in cache.kept_positions(layer):
            assert set(question.tolist()) <= set(positions.tolist())


def test_random_reproducible_by_seed(model, ids):
    a = kvsieve.compress(model, ids, "random", 0.6, seed=7)
    b = kvsieve.compress(model, ids, "random:seed=7", 0.6)
    c = kvsieve.compress(model, ids, "random", 0.6, seed=8)
    same = all(torch.equal(x, y) for x, y in zip(a.kept_positions(1), b.kept_positions(1), strict=True))
    differ = any(not torch.equal(x, y) for x, y in zip(a.kept_positions(1), c.kept_positions(1), strict=True))
    assert same and differ


def test_streaming_keeps_sinks_and_most_recent(model, ids):
    cache = kvsieve.compress(model, ids, "streaming", 0.5, n_sink=1, sliding_window=8)
    kept = cache.kept_positions(0)[0]
    n_keep = len(kept)
    assert kept.tolist() == [0, *range(120 - (n_keep - 1), 120)]


def test_nbytes_matches_kept_tensors_and_shrinks(model, ids):
    full = kvsieve.observe_prefill(model, ids).cache
    head_dim, n_layers, n_kv = 16, 3, 2
    assert full.nbytes() == 2 * n_layers * n_kv * 120 * head_dim * 4
    rate = 0.75
    cache = kvsieve.compress(model, ids, "importance", rate, n_sink=1, sliding_window=7)
    tensor_bytes = sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (*layer.head_keys, *layer.head_values)
    )
    assert cache.nbytes() == tensor_bytes
    kept = 120 - evicted_count(112, rate)
    assert cache.nbytes() == full.nbytes() * kept // 120


def test_evicted_tensors_are_released(model, ids):
    prefill = kvsieve.observe_prefill(model, ids)
    cache = prefill.cache
    del prefill
    old = [weakref.ref(t) for layer in cache.layers for t in layer.head_keys + layer.head_values]
    cache.evict([[torch.arange(0, 120, 2)] * 2] * 3)
    gc.collect()
    assert all(r() is None for r in old)
    assert cache.stored_lengths() == [[60, 60]] * 3


def test_keep_leaves_the_source_cache_untouched(model, ids):
    prefill = kvsieve.observe_prefill(model, ids[:, :100])
    smaller = prefill.cache.keep([[torch.arange(10)] * 2] * 3)
    model(ids[:, 100:], past_key_values=smaller)
    assert prefill.cache.stored_lengths() == [[100, 100]] * 3
    assert smaller.stored_lengths() == [[30, 30]] * 3
    assert smaller.get_seq_length() == 120
    assert smaller.kept_positions(2)[1].tolist() == [*range(10), *range(100, 120)]
