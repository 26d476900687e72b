"""Allocators: same total as uniform, where the budget goes, and exact decoding over the ragged caches they make."""

from __future__ import annotations

import pytest
import torch

import kvsieve
from conftest import tiny_llama
from kvsieve.runtime.storage.segments import BLOCK
from kvsieve.selection.allocators import (
    ALLOCATORS,
    Adaptive,
    Global,
    Pyramid,
    apportion,
    mass_share,
    pooled_counts,
    pyramid_budgets,
    zscore,
)
from kvsieve.selection.budget import Rate, uniform_keep

SPECS = ["uniform", "pyramid", "adaptive", "global", "global:calibration=zscore", "global:safeguard=0.5"]


def _scores(layers: int = 4, heads: int = 3, n: int = 50, seed: int = 0) -> tuple[list, list]:
    """Scores `[heads, n]` per layer and the per-head evictable masks (all but the first 2 and last 5 entries)."""
    gen = torch.Generator().manual_seed(seed)
    scores = [torch.rand(heads, n, generator=gen) ** (1 + 3 * layer) for layer in range(layers)]
    protected = torch.zeros(n, dtype=torch.bool)
    protected[:2] = protected[-5:] = True
    evictable = [(~protected).expand(heads, -1) for _ in range(layers)]
    return scores, evictable


def _shares(evictable: list, rate: float) -> list[list[int]]:
    """Uniform shares of a rate budget."""
    return Rate(rate).shares(evictable, [~e for e in evictable])


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("rate", [0.0, 0.3, 0.8, 0.95])
def test_every_allocator_keeps_the_uniform_total(spec, rate):
    """The rate is the rate: every allocator keeps exactly as many entries as uniform, within each head's range."""
    scores, evictable = _scores()
    allocator = kvsieve.make_policy(f"random+{spec}").allocator
    counts = allocator.counts(scores, evictable, _shares(evictable, rate))
    n_evictable = 43
    assert sum(map(sum, counts)) == 4 * 3 * uniform_keep(n_evictable, rate)
    assert all(0 <= c <= n_evictable for layer in counts for c in layer)


def test_pyramid_decreases_with_depth_and_follows_beta():
    budgets = pyramid_budgets(40.0, 5, beta=20)
    assert budgets == sorted(budgets, reverse=True)
    assert budgets[-1] == pytest.approx(2.0) and budgets[0] == pytest.approx(78.0)
    assert sum(budgets) / 5 == pytest.approx(40.0)
    scores, evictable = _scores(layers=5, n=200)
    counts = Pyramid(beta=20).counts(scores, evictable, _shares(evictable, 0.8))
    per_layer = [sum(layer) for layer in counts]
    assert per_layer == sorted(per_layer, reverse=True) and per_layer[0] > 5 * per_layer[-1]


def test_pyramid_clips_at_the_evictable_entries_and_redistributes():
    scores, evictable = _scores(layers=4, n=50)
    # layer 0's share would exceed its 43 evictable entries
    counts = Pyramid().counts(scores, evictable, _shares(evictable, 0.1))
    assert max(max(layer) for layer in counts) == 43
    assert sum(map(sum, counts)) == 12 * uniform_keep(43, 0.1)


def test_apportion_respects_caps_and_total():
    assert apportion([2.5, 2.5, 5.0], [10, 10, 3], 10) == [4, 3, 3]  # 2 over the cap go to the others
    assert apportion([1.0, 1.0], [5, 5], 2) == [1, 1]
    with pytest.raises(ValueError, match="cannot place 11 entries"):
        apportion([1.0], [10], 11)


def test_pooled_counts_is_topk_of_the_union_after_floors():
    scores = [torch.tensor([9.0, 8.0, 7.0, 6.0]), torch.tensor([1.0, 0.5, 0.2, 0.1])]
    assert pooled_counts(scores, [0, 0], 4) == [4, 0]
    assert pooled_counts(scores, [0, 1], 4) == [3, 1]
    assert pooled_counts(scores, [2, 2], 4) == [2, 2]


def test_adaptive_keeps_layer_totals_and_favours_concentrated_heads():
    """Within a layer, a head whose scores beat the others' takes their budget above the safeguard floor."""
    n = 60
    strong = torch.linspace(1.0, 2.0, n)
    weak = torch.linspace(0.0, 0.5, n)
    scores = [torch.stack([strong, weak])]
    evictable = [torch.ones(2, n, dtype=torch.bool)]
    counts = Adaptive(safeguard=0.2).counts(scores, evictable, _shares(evictable, 0.5))
    assert sum(counts[0]) == 2 * 30
    assert counts[0] == [54, 6]  # floor = floor(0.2 * 30) = 6 for the weak head
    assert Adaptive(safeguard=1.0).counts(scores, evictable, _shares(evictable, 0.5)) == [[30, 30]]


def test_global_moves_budget_across_layers_on_calibrated_scores():
    """A layer whose attention is concentrated needs fewer entries to keep its mass: mass calibration gives it less."""
    n = 80
    peaked = torch.full((2, n), 1e-4)
    peaked[:, 10:14] = 1.0
    flat = torch.rand(2, n, generator=torch.Generator().manual_seed(0)) + 1.0
    scores, evictable = [peaked, flat], [torch.ones(2, n, dtype=torch.bool)] * 2
    counts = Global().counts(scores, evictable, _shares(evictable, 0.5))
    assert sum(counts[0]) < sum(counts[1]) and sum(map(sum, counts)) == 4 * 40
    floored = Global(safeguard=0.5).counts(scores, evictable, _shares(evictable, 0.5))
    assert min(min(layer) for layer in floored) >= 20


def test_calibrations():
    s = torch.tensor([1.0, 3.0, 4.0])
    torch.testing.assert_close(mass_share(s), s / 8)
    torch.testing.assert_close(mass_share(torch.tensor([-1.0, 1.0])), torch.tensor([0.0, 1.0]))
    z = zscore(torch.tensor([1.0, 2.0, 3.0, 10.0]))
    assert abs(float(z.mean())) < 1e-6 and float(z.std()) == pytest.approx(1.0)
    assert torch.equal(zscore(torch.ones(5)), torch.zeros(5))


def test_registry_names():
    assert list(ALLOCATORS) == ["uniform", "pyramid", "adaptive", "global"]
    assert Global().calibration == "auto" and Adaptive().safeguard == 0.2 and Pyramid().beta == 20.0


GQA = {"layers": 3, "heads": 6, "kv_heads": 3}


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("scorer", ["snapkv", "importance", "expected"])
@torch.no_grad()
def test_ragged_decoding_equals_masked_full_cache(masked_reference, scorer, spec):
    """Every allocator's ragged cache decodes like a full cache masking the dropped entries per (layer, head)."""
    model = tiny_llama(seed=5, layers=3, heads=4, kv_heads=2)
    ids = torch.randint(0, 128, (1, 110), generator=torch.Generator().manual_seed(4))
    prefix, cont = ids[:, :90], ids[:, 90:]
    cache = kvsieve.compress(model, prefix, f"{scorer}+{spec}", 0.8, n_recent=8)
    kept = [cache.kept_positions(layer) for layer in range(3)]
    with kvsieve.sieve_attention(model):
        ours = model(cont, past_key_values=cache).logits
    with masked_reference(model, prefix, kept) as ref:
        expected = model(cont, past_key_values=ref.cache).logits
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("spec", ["snapkv+adaptive", "tova+global", "critical+pyramid"])
@torch.no_grad()
def test_ragged_generate_equals_masked_full_cache(masked_reference, spec):
    """Greedy generation from ragged caches on a GQA model (group 2, 3 kv-heads) matches the masked reference."""
    model = tiny_llama(seed=6, **GQA)
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(8))
    cache = kvsieve.compress(model, ids[:, :99], spec, 0.8, n_recent=8)
    assert len({n for layer in cache.stored_lengths() for n in layer}) > 1, "expected a ragged cache"
    kept = [cache.kept_positions(layer) for layer in range(3)]
    gen = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with kvsieve.sieve_attention(model):
        ours = model.generate(ids, past_key_values=cache, **gen)
    with masked_reference(model, ids[:, :99], kept) as ref:
        expected = model.generate(ids, past_key_values=ref.cache, **gen)
    assert torch.equal(ours, expected)


def _allocated_bytes(cache: kvsieve.SievedCache) -> int:
    """Bytes of the distinct storages behind every layer's flat key and value buffers."""
    storages = {}
    for layer in cache.layers:
        for tensor in layer.segments.data:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("spec", ["snapkv+adaptive", "snapkv+global", "knorm+global:calibration=zscore"])
def test_ragged_cache_really_holds_only_the_kept_entries(spec):
    """`nbytes()` and the allocated storage both match the kept entries (within 2%), unlike masking.

    Decoding appends into free room that grows by 2% of a segment (at least one block) at a time.
    """
    model = tiny_llama(seed=2, **GQA)
    ids = torch.randint(0, 128, (1, 400), generator=torch.Generator().manual_seed(3))
    full = kvsieve.compress(model, ids, "snapkv", 0.0)
    cache = kvsieve.compress(model, ids, spec, 0.8)
    kept_entries = sum(map(sum, cache.stored_lengths()))
    entry_bytes = 2 * cache.layers[0].segments.data[0].shape[-1] * 4  # key + value, float32
    assert len({n for layer in cache.stored_lengths() for n in layer}) > 1
    assert cache.nbytes() == kept_entries * entry_bytes
    assert abs(_allocated_bytes(cache) - kept_entries * entry_bytes) <= 0.02 * kept_entries * entry_bytes
    assert _allocated_bytes(cache) < 0.35 * _allocated_bytes(full)
    assert cache.allocated_nbytes() == _allocated_bytes(cache)

    # decoding appends in place; storage grows by at most 2% plus one block of room per (layer, kv-head)
    # and one null (padding) entry per layer
    with torch.no_grad(), kvsieve.sieve_attention(model):
        for step in range(30):
            model(ids[:, 399 - step : 400 - step], past_key_values=cache, cache_position=torch.tensor([400 + step]))
    kept_entries = sum(map(sum, cache.stored_lengths()))
    assert cache.nbytes() == kept_entries * entry_bytes
    assert cache.allocated_nbytes() == _allocated_bytes(cache)
    assert _allocated_bytes(cache) <= 1.02 * cache.nbytes() + (9 * BLOCK + 3) * entry_bytes


def test_global_auto_calibration_pools_calibrated_scores_raw():
    """`auto` is `mass` for per-head scores and `raw` for scores on one scale (`Scorer.calibrated`)."""
    scores = [torch.tensor([[10.0, 9.9, 9.8], [3.0, 2.9, 0.1]])]  # raw: head 0 outranks; mass: head 1 is peaked
    evictable = [torch.ones(2, 3, dtype=torch.bool)]
    shares = [[2, 2]]
    assert Global().counts(scores, evictable, shares, calibrated=True) == [[3, 1]]
    assert Global(calibration="raw").counts(scores, evictable, shares) == [[3, 1]]
    assert Global().counts(scores, evictable, shares) == Global(calibration="mass").counts(scores, evictable, shares)
    assert Global().counts(scores, evictable, shares) == [[2, 2]]
