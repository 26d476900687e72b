"""SievedCache bookkeeping: kept counts, protection, reproducibility, bytes, storage, release of evicted tensors."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import kvsieve
from conftest import tiny_llama
from kvsieve.runtime.storage.segments import BLOCK, PAD_POSITION, Segments
from kvsieve.selection.allocators import ALLOCATORS
from kvsieve.selection.budget import evicted_count
from specs import SCORER_SPECS


@pytest.mark.parametrize("policy", SCORER_SPECS)
@pytest.mark.parametrize("rate", [0.0, 0.3, 0.8])
def test_kept_counts_and_protection(model, ids, policy, rate):
    n_sink, window = 4, 16
    cache = kvsieve.compress(model, ids, policy, rate, n_sink=n_sink, n_recent=window)
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
    cache = kvsieve.compress(model, ids, "streaming", 0.5, n_sink=1, n_recent=8)
    kept = cache.kept_positions(0)[0]
    n_keep = len(kept)
    assert kept.tolist() == [0, *range(120 - (n_keep - 1), 120)]


def test_nbytes_matches_kept_tensors_and_shrinks(model, ids):
    full = kvsieve.observe_prefill(model, ids).cache
    head_dim, n_layers, n_kv = 16, 3, 2
    assert full.nbytes() == 2 * n_layers * n_kv * 120 * head_dim * 4
    rate = 0.75
    cache = kvsieve.compress(model, ids, "importance", rate, n_sink=1, n_recent=7)
    stored = sum(
        k.numel() * k.element_size() + v.numel() * v.element_size()
        for layer in cache.layers
        for h in range(n_kv)
        for k, v, _ in [layer.segments.segment(0, h)]
    )
    assert cache.nbytes() == stored
    kept = 120 - evicted_count(112, rate)
    assert cache.nbytes() == full.nbytes() * kept // 120


def test_evicted_tensors_are_released(model, ids):
    prefill = kvsieve.observe_prefill(model, ids)
    cache = prefill.cache
    del prefill
    old = [weakref.ref(t) for layer in cache.layers for t in layer.segments.data]
    cache.evict([[[torch.arange(0, 120, 2)] * 2] * 3])
    gc.collect()
    assert all(r() is None for r in old)
    assert cache.stored_lengths() == [[60, 60]] * 3


def test_keep_leaves_the_source_cache_untouched(model, ids):
    prefill = kvsieve.observe_prefill(model, ids[:, :100])
    smaller = prefill.cache.keep([[[torch.arange(10)] * 2] * 3])
    with kvsieve.sieve_attention(model), torch.no_grad():
        model(ids[:, 100:], past_key_values=smaller)
    assert prefill.cache.stored_lengths() == [[100, 100]] * 3
    assert smaller.stored_lengths() == [[30, 30]] * 3
    assert smaller.get_seq_length() == 120
    assert smaller.kept_positions(2)[1].tolist() == [*range(10), *range(100, 120)]


def _buffer_bytes(cache: kvsieve.SievedCache) -> int:
    """Bytes of the distinct storages behind every layer's key and value buffers."""
    storages = {}
    for layer in cache.layers:
        for tensor in layer.segments.data:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("allocator", list(ALLOCATORS))
@torch.no_grad()
def test_storage_stays_within_two_percent_of_the_kept_entries(allocator):
    """Right after compression and after 1,000 decode steps, for every allocator and a batch of two sequences."""
    model = tiny_llama(seed=2, layers=2, heads=6, kv_heads=3)
    ids = torch.randint(0, 128, (2, 400), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0  # the second sequence is left-padded: fewer real tokens, its own budget
    cache = kvsieve.compress(model, ids, "snapkv", 0.8, allocator=allocator, attention_mask=mask)
    entry = cache.layers[0].segments.entry_bytes()
    null_entries = entry * len(cache.layers)  # one padding row per layer
    blocks = entry * BLOCK * 2 * 3 * len(cache.layers)  # at most one block of room per (row, kv-head)

    def check() -> None:
        kept = sum(sum(map(sum, cache.stored_lengths(row))) for row in range(2)) * entry
        assert cache.nbytes() == kept
        assert _buffer_bytes(cache) == cache.allocated_nbytes()
        assert kept <= cache.allocated_nbytes() <= 1.02 * kept + null_entries
        assert cache.allocated_nbytes() - kept <= max(0.02 * kept, blocks) + null_entries

    check()
    assert cache.allocated_nbytes() == cache.nbytes() + null_entries, "exactly sized right after compression"
    token = ids[:, -1:]
    with kvsieve.sieve_attention(model):
        for step in range(1000):
            model(token, past_key_values=cache, attention_mask=torch.cat([mask, torch.ones(2, step + 1)], -1))
    assert cache.get_seq_length() == 1400
    check()


def test_segments_append_grow_and_pad():
    """Appending grows a segment's room by 2% (at least a block) at a time; padded views pad with PAD_POSITION."""
    keys = torch.randn(1, 2, 100, 4)
    segments = Segments.from_dense(keys, keys + 1, torch.arange(100))
    assert segments.grid and segments.free == 0
    smaller = segments.select([0, 1], [torch.arange(60), torch.arange(0, 100, 2)], rows=1)
    assert smaller.lengths == [60, 50] and not smaller.grid
    view = smaller.padded()
    assert view.keys.shape == (1, 2, 60, 4)
    assert torch.equal(view.keys[0, 1, :50], keys[0, 1, ::2]) and torch.equal(view.keys[0, 1, 50:], torch.zeros(10, 4))
    positions = view.slots.positions()
    assert (positions[0, 1, 50:] == PAD_POSITION).all() and torch.equal(positions[0, 0], torch.arange(60))
    assert torch.equal(view.slots.valid()[0], torch.arange(60) < torch.tensor([[60], [50]]))
    new = torch.randn(1, 2, 1, 4)
    smaller.append(new, new, torch.tensor([100]))
    assert smaller.capacity == [61 + BLOCK, 51 + BLOCK] and smaller.lengths == [61, 51], "a block of room"
    assert torch.equal(smaller.segment(0, 1)[0][-1], new[0, 1, 0])
    for _ in range(BLOCK + 5):
        smaller.append(new, new, torch.tensor([101]))
    assert smaller.lengths == [82, 72]
    assert all(c - n <= BLOCK for c, n in zip(smaller.capacity, smaller.lengths, strict=True))
    long = Segments.from_dense(torch.randn(1, 1, 3000, 4), torch.randn(1, 1, 3000, 4), torch.arange(3000))
    long.append(new[:, :1], new[:, :1], torch.tensor([3000]))
    assert long.capacity == [3001 + 60], "2% of a long segment"
    assert torch.equal(smaller.segment(0, 0)[0][:60], keys[0, 0, :60]), "entries survive every move"
    view = smaller.padded()
    assert torch.equal(view.keys[0, 1, :72], smaller.segment(0, 1)[0]) and int(view.slots.valid()[0, 1].sum()) == 72


@torch.no_grad()
def test_layouts_handed_to_attention_do_not_outlive_their_tensors(model, ids):
    """Nothing keeps the padded tensors of past forwards alive (the scope's layout table holds them weakly)."""
    from kvsieve.runtime.storage.layout import active_scope

    cache = kvsieve.compress(model, ids[:, :100], "snapkv+adaptive", 0.5)
    with kvsieve.sieve_attention(model):
        for step in range(5):
            model(ids[:, 100 + step : 101 + step], past_key_values=cache)
        gc.collect()
        assert len(active_scope().layouts) == 0
    assert active_scope() is None, "the table goes with the block"
    assert cache.layers[0].keys is None, "layers keep no padded copy between forwards"
