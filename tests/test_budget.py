"""Budgets as a size: max_tokens and max_bytes hold what they say, pick what the equivalent rate picks, and refuse
what cannot be met."""

from __future__ import annotations

import pytest
import torch

import kvsieve
from conftest import tiny_llama
from kvsieve.selection.budget import MaxBytes, MaxTokens, Rate, make_budget

SPECS = ["snapkv", "snapkv+pyramid", "importance+adaptive", "random+global"]
N = 100  # context tokens; 1 sink + 32 recent are protected per head, 67 evictable


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("max_tokens", [40, 60])
def test_max_tokens_holds_that_many_entries_per_head_on_average(model, ids, spec, max_tokens):
    cache = kvsieve.compress(model, ids[:, :N], spec, max_tokens=max_tokens)
    lengths = cache.stored_lengths()
    assert sum(map(sum, lengths)) == max_tokens * 3 * 2, "layers x kv-heads x max_tokens, protected included"
    if spec == "snapkv":
        assert lengths == [[max_tokens] * 2] * 3, "uniform: every head holds exactly max_tokens"


def test_max_tokens_above_the_sequence_keeps_everything(model, ids):
    assert kvsieve.compress(model, ids[:, :N], "snapkv", max_tokens=500).stored_lengths() == [[N] * 2] * 3


@pytest.mark.parametrize("spec", ["snapkv:window=64", "tova", "trimkv+global:gates=untrained", "random"])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_a_prompt_that_fits_the_size_is_kept_without_scoring(model, ids, spec, tokens):
    """Nothing to evict: no scorer runs, so a prompt shorter than a scorer's window of queries is no error."""
    cache = kvsieve.compress(model, ids[:, :tokens], spec, max_tokens=40)
    assert cache.stored_lengths() == [[tokens] * 2] * 3
    assert all(p.tolist() == list(range(tokens)) for layer in range(3) for p in cache.kept_positions(layer))


@pytest.mark.parametrize("spec", SPECS)
def test_max_tokens_keeps_what_the_equivalent_rate_keeps(model, ids, spec):
    """A size budget changes how many entries stay, not which: 60 entries per head = rate 40/67 of the evictable."""
    prefill = kvsieve.observe_prefill(model, ids[:, :N], kvsieve.make_policy(spec).needs)
    policy = kvsieve.make_policy(spec)
    by_size = policy.select(prefill.observations[0], MaxTokens(60))
    by_rate = policy.select(prefill.observations[0], Rate((67 - 27) / 67))
    assert all(torch.equal(a, b) for la, lb in zip(by_size, by_rate, strict=True) for a, b in zip(la, lb, strict=True))


def test_max_bytes_holds_the_largest_whole_number_of_entries_per_head(model, ids):
    entry = 2 * 16 * 4  # key + value, head_dim 16, float32
    heads = 3 * 2
    budget = 50 * heads * entry + entry  # 50 entries per head and change
    cache = kvsieve.compress(model, ids[:, :N], "snapkv+adaptive", max_bytes=budget)
    assert cache.nbytes() == 50 * heads * entry <= budget
    assert cache.allocated_nbytes() <= budget + heads * entry, "exact storage: kept entries plus one null entry a layer"


def test_size_budgets_in_a_padded_batch_count_each_rows_real_tokens():
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, N), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :30] = 0  # row 1 is left-padded: 70 real tokens
    cache = kvsieve.compress(model, ids, "snapkv", max_tokens=50, attention_mask=mask)
    assert cache.stored_lengths(0) == [[50] * 2] * 3 and cache.stored_lengths(1) == [[50] * 2] * 3
    positions = cache.kept_positions(0, row=1)
    assert all(int(p.min()) >= 30 for p in positions), "pads are never kept or counted"


def test_one_budget_at_a_time_and_each_in_range(model, ids):
    with pytest.raises(kvsieve.PolicyError, match="give one budget, not rate and max_tokens"):
        kvsieve.compress(model, ids[:, :N], "snapkv", 0.5, max_tokens=40)
    with pytest.raises(kvsieve.PolicyError, match="not max_tokens and max_bytes"):
        make_budget(max_tokens=4, max_bytes=4096)
    with pytest.raises(kvsieve.PolicyError, match="max_tokens must be an integer >= 1, got 0"):
        kvsieve.compress(model, ids[:, :N], "snapkv", max_tokens=0)
    with pytest.raises(kvsieve.PolicyError, match=r"max_bytes must be an integer >= 1, got 1.5"):
        MaxBytes(1.5)
    assert make_budget() == Rate(0.5)


def test_a_budget_below_the_protected_entries_names_them(model, ids):
    with pytest.raises(kvsieve.PolicyError, match="max_tokens=20 is smaller than the 33 protected entries"):
        kvsieve.compress(model, ids[:, :N], "snapkv", max_tokens=20)
    with pytest.raises(kvsieve.PolicyError, match="sequence 0 of the batch: max_tokens=20"):
        kvsieve.compress(model, ids[:, :N].repeat(2, 1), "snapkv", max_tokens=20)


def test_a_byte_budget_below_one_entry_per_head_says_how_much_is_needed(model, ids):
    with pytest.raises(kvsieve.PolicyError, match=r"below one entry per \(layer, kv-head\): 6 heads x 128 bytes = 768"):
        kvsieve.compress(model, ids[:, :N], "snapkv", max_bytes=700)


def test_max_tokens_gives_what_short_heads_cannot_use_to_the_others():
    """An evicted cache's heads hold different counts: the average still holds (a pooled allocator sums the shares)."""
    room = torch.arange(50)[None, :] < torch.tensor([[5], [45], [30]])  # evictable entries per head: 5, 45, 30
    protected = torch.zeros(3, 50, dtype=torch.bool)
    assert MaxTokens(20).shares([room], [protected]) == [[5, 28, 27]]
    assert MaxTokens(4).shares([room], [protected]) == [[4, 4, 4]]
    assert MaxTokens(40).shares([room], [protected]) == [[5, 45, 30]]  # everything they hold, and no more
