"""Sieve attention + SievedCache against plain transformers: exact without eviction, masked reference with it."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvsieve
from conftest import tiny_llama
from kvsieve.kernels import attention as kernels
from kvsieve.selection.allocators import ALLOCATORS
from specs import SCORER_SPECS

GEN = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}


@torch.no_grad()
def test_full_cache_logits_match_plain_transformers(model, ids):
    model.set_attn_implementation("sdpa")
    reference_cache = DynamicCache()
    ref_prefix = model(ids[:, :80], past_key_values=reference_cache).logits
    ref_cont = model(ids[:, 80:], past_key_values=reference_cache).logits

    prefill = kvsieve.observe_prefill(model, ids[:, :80])
    assert model.config._attn_implementation == "sdpa", "the prefill's switch to sieve attention is scoped"
    with kvsieve.sieve_attention(model):
        assert model.config._attn_implementation == "sieve"
        ours_cont = model(ids[:, 80:], past_key_values=prefill.cache).logits
    torch.testing.assert_close(prefill.last_logits, ref_prefix[:, -1], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_cont, ref_cont, atol=1e-5, rtol=0)
    assert prefill.cache.get_seq_length() == 120


@torch.no_grad()
def test_rate_zero_generate_matches_plain_transformers(model, ids):
    model.set_attn_implementation("sdpa")
    expected = model.generate(ids, **GEN)
    cache = kvsieve.compress(model, ids[:, :100], "importance", rate=0.0)
    assert cache.stored_lengths() == [[100, 100]] * 3
    with kvsieve.sieve_attention(model):
        got = model.generate(ids, past_key_values=cache, **GEN)
    assert torch.equal(got, expected)
    # nothing was evicted: the cache is a plain cache that the model's own attention reads as well
    again = kvsieve.compress(model, ids[:, :100], "importance", rate=0.0)
    assert torch.equal(model.generate(ids, past_key_values=again, **GEN), expected)


@pytest.mark.parametrize("allocator", list(ALLOCATORS))
@pytest.mark.parametrize("policy", SCORER_SPECS)
@torch.no_grad()
def test_evicted_cache_equals_masked_full_cache(model, ids, masked_reference, policy, allocator):
    """The central check, every scorer x allocator: physical eviction == the full cache masking the dropped entries."""
    prefix, cont = ids[:, :90], ids[:, 90:]
    cache = kvsieve.compress(model, prefix, policy, 0.7, allocator=allocator, n_recent=8)
    kept = [cache.kept_positions(layer) for layer in range(3)]
    assert all(len(p) < 90 for heads in kept for p in heads)
    with kvsieve.sieve_attention(model):
        ours = model(cont, past_key_values=cache).logits
    with masked_reference(model, prefix, kept) as ref:
        expected = model(cont, past_key_values=ref.cache).logits
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    everything = [[torch.arange(90)] * 2] * 3
    with masked_reference(model, prefix, everything) as ref:
        unmasked = model(cont, past_key_values=ref.cache).logits
    assert (unmasked - ours).abs().max() > 1e-3, "eviction should change the continuation"


@pytest.mark.parametrize("rate", [0.5, 0.9])
@torch.no_grad()
def test_every_rate_equals_masked_full_cache(model, ids, masked_reference, rate):
    prefix, cont = ids[:, :90], ids[:, 90:]
    cache = kvsieve.compress(model, prefix, "snapkv+adaptive", rate, n_recent=8)
    kept = [cache.kept_positions(layer) for layer in range(3)]
    with kvsieve.sieve_attention(model):
        ours = model(cont, past_key_values=cache).logits
    with masked_reference(model, prefix, kept) as ref:
        expected = model(cont, past_key_values=ref.cache).logits
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


@torch.no_grad()
def test_evicted_generate_equals_masked_full_cache(model, ids, masked_reference):
    prefix = ids[:, :100]
    cache = kvsieve.compress(model, prefix, "importance", 0.7, n_recent=8)
    kept = [cache.kept_positions(layer) for layer in range(3)]
    with kvsieve.sieve_attention(model):
        ours = model.generate(ids, past_key_values=cache, **GEN)
    with masked_reference(model, prefix, kept) as ref:
        expected = model.generate(ids, past_key_values=ref.cache, **GEN)
    assert torch.equal(ours, expected)
    assert cache.get_seq_length() == ids.shape[1] + GEN["max_new_tokens"] - 1


@torch.no_grad()
def test_ragged_heads_equal_masked_full_cache(masked_reference):
    """Heads keeping arbitrary, different numbers of entries stay exact, for one- and many-token feeds."""
    model = tiny_llama(seed=3)
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(2))
    prefill = kvsieve.observe_prefill(model, ids[:, :50])
    gen = torch.Generator().manual_seed(0)
    keep = [[torch.randperm(50, generator=gen)[: 10 + 15 * h].sort().values for h in range(2)] for _ in range(3)]
    prefill.cache.evict([keep])
    assert prefill.cache.stored_lengths() == [[10, 25]] * 3
    kept = [prefill.cache.kept_positions(layer) for layer in range(3)]
    with kvsieve.sieve_attention(model):
        first = model(ids[:, 50:51], past_key_values=prefill.cache).logits
        rest = model(ids[:, 51:], past_key_values=prefill.cache).logits
    with masked_reference(model, ids[:, :50], kept) as ref:
        expected = model(ids[:, 50:], past_key_values=ref.cache).logits
    torch.testing.assert_close(torch.cat([first, rest], dim=1), expected, atol=1e-4, rtol=0)


@torch.no_grad()
def test_observed_statistics_match_dense_attention(model, ids):
    """`received` equals the column sums of the dense causal attention; window attention equals its last rows."""
    model.set_attn_implementation("eager")
    probs = model(ids[:, :64], output_attentions=True).attentions  # per layer [1, heads, q, k]
    prefill = kvsieve.observe_prefill(model, ids[:, :64], kvsieve.Needs(window=5, accumulated=True))
    for layer, obs in enumerate(prefill.observations[0]):
        torch.testing.assert_close(obs.received("test"), probs[layer][0].sum(1), atol=1e-5, rtol=0)
        torch.testing.assert_close(obs.window_attention(5), probs[layer][0, :, -5:], atol=1e-5, rtol=0)
        torch.testing.assert_close(obs.window_attention(1), probs[layer][0, :, -1:], atol=1e-5, rtol=0)
        assert torch.equal(obs.queries_seeing(), torch.arange(64, 0, -1).expand(2, -1))


@torch.no_grad()
def test_chunked_observation_is_exact(model, ids, monkeypatch):
    """Tiny query chunks give the same outputs and statistics as one chunk."""
    needs = kvsieve.Needs(window=4, accumulated=True)
    whole = kvsieve.observe_prefill(model, ids, needs)
    monkeypatch.setattr(kernels, "CHUNK_ELEMENTS", 64)
    chunked = kvsieve.observe_prefill(model, ids, needs)
    torch.testing.assert_close(chunked.last_logits, whole.last_logits, atol=1e-5, rtol=0)
    for a, b in zip(whole.observations[0], chunked.observations[0], strict=True):
        torch.testing.assert_close(a.received("test"), b.received("test"), atol=1e-5, rtol=0)


@torch.no_grad()
def test_prefill_without_accumulation_is_exact(model, ids):
    """Window-only observation (fused SDPA path) gives the same logits, queries and cache as the accumulating one."""
    accumulated = kvsieve.observe_prefill(model, ids, kvsieve.Needs(window=8, accumulated=True))
    fused = kvsieve.observe_prefill(model, ids, kvsieve.Needs(window=8))
    torch.testing.assert_close(fused.last_logits, accumulated.last_logits, atol=1e-5, rtol=0)
    for a, b in zip(accumulated.observations[0], fused.observations[0], strict=True):
        assert b.stats.received is None and a.stats.received is not None
        torch.testing.assert_close(b.stats.window_queries, a.stats.window_queries, atol=1e-5, rtol=0)
        torch.testing.assert_close(b.keys, a.keys, atol=1e-5, rtol=0)


@torch.no_grad()
def test_prefill_records_only_what_is_needed(model, ids):
    bare = kvsieve.observe_prefill(model, ids, kvsieve.Needs())
    stats, facts = bare.observations[0][0].stats, bare.observations[0][0].facts
    assert stats.window_queries is None and stats.received is None and facts.output_weight is None
    needs = kvsieve.make_policy("critical:window=4").needs
    assert needs == kvsieve.Needs(window=4, output_projection=True)
    observation = kvsieve.observe_prefill(model, ids, needs).observations[0][1]
    stats = observation.stats
    assert stats.window_queries.shape == (4, 4, 16) and stats.received is None
    assert torch.equal(observation.facts.output_weight, model.model.layers[1].self_attn.o_proj.weight)
