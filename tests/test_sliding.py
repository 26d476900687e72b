"""Models with sliding-window layers: Gemma-3 (sliding and full layers) and Mistral (every layer sliding)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Gemma2Config, Gemma2ForCausalLM

import kvsieve
from conftest import WINDOW, tiny_gemma3, tiny_llama, tiny_mistral
from kvsieve.harness.eval import diagnose, survival_from_cache
from kvsieve.runtime.api.evictions import Eviction, evictions
from kvsieve.runtime.storage.sliding import SlidingLayer

PROMPT, STEPS = 40, 30  # the decode runs well past the window of 16
FULL = [1, 3]  # the full-attention layers of tiny_gemma3


def _ids(seed: int, n: int = PROMPT + STEPS, rows: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (rows, n), generator=torch.Generator().manual_seed(seed))


def _full_kept(cache: kvsieve.SievedCache) -> dict[int, list[torch.Tensor]]:
    return {layer: cache.kept_positions(layer) for layer in cache.full_layers}


@pytest.mark.parametrize("make", [tiny_gemma3, tiny_mistral])
@torch.no_grad()
def test_nothing_evicted_equals_plain_transformers_past_the_window(make):
    """Step by step past the window, a SievedCache under sieve attention gives transformers' own logits."""
    model, ids = make(), _ids(0)
    reference = DynamicCache(config=model.config)
    expected = [model(ids[:, :PROMPT], past_key_values=reference).logits[:, -1]]
    expected += [model(ids[:, t : t + 1], past_key_values=reference).logits[:, -1] for t in range(PROMPT, ids.shape[1])]
    cache = kvsieve.compress(model, ids[:, :PROMPT], "snapkv", rate=0.0)
    ours = [kvsieve.observe_prefill(model, ids[:, :PROMPT]).last_logits]
    with kvsieve.sieve_attention(model):
        ours += [model(ids[:, t : t + 1], past_key_values=cache).logits[:, -1] for t in range(PROMPT, ids.shape[1])]
    torch.testing.assert_close(torch.stack(ours), torch.stack(expected), atol=1e-5, rtol=0)
    sliding = [layer for layer in cache.layers if layer.is_sliding]
    assert sliding and all(isinstance(layer, SlidingLayer) for layer in sliding)
    for layer in sliding:  # transformers' rolling window: the last WINDOW - 1 tokens
        assert layer.stored_lengths() == [WINDOW - 1] * 2
        assert all(
            torch.equal(p, torch.arange(ids.shape[1] - WINDOW + 1, ids.shape[1])) for p in layer.kept_positions()
        )


def test_mistral_with_a_sliding_window_has_nothing_to_evict():
    """transformers 5.2 makes every Mistral layer sliding when `sliding_window` is set: a policy is refused, clearly."""
    model, ids = tiny_mistral(), _ids(1)
    assert kvsieve.SievedCache.for_model(model).full_layers == []
    for budget in ({"rate": 0.5}, {"max_tokens": 8}, {"max_bytes": 1 << 20}):
        with pytest.raises(kvsieve.PolicyError, match=r"nothing to evict: every layer of MistralForCausalLM .*window"):
            kvsieve.compress(model, ids, "snapkv", **budget)
    with pytest.raises(kvsieve.PolicyError, match="nothing to evict"):
        kvsieve.bounded_cache(model, max_tokens=8)
    with pytest.raises(kvsieve.PolicyError, match="nothing to evict"), kvsieve.apply(model, kvsieve.EvictionConfig()):
        model.generate(ids, max_new_tokens=2, pad_token_id=0)
    assert kvsieve.compress(model, ids, "snapkv", rate=0.0).stored_lengths() == [[WINDOW - 1] * 2] * 2


@pytest.mark.parametrize(
    ("spec", "budget"),
    [
        ("snapkv", {"rate": 0.8}),
        ("snapkv", {"max_tokens": 20}),
        ("importance+adaptive", {"rate": 0.6}),
        ("expected+global", {"rate": 0.7}),  # reads the rotary embedding of the full-attention layers
        ("knorm+pyramid", {"max_tokens": 24}),
    ],
)
@torch.no_grad()
def test_evicted_full_layers_equal_the_masked_reference(masked_reference, spec, budget):
    """Full layers evicted by the policy, sliding layers on their window: decoding equals a float64 full cache that
    masks what the full layers dropped and keeps the sliding mask on the sliding layers."""
    model, ids = tiny_gemma3(), _ids(2)
    cache = kvsieve.compress(model, ids[:, :PROMPT], spec, n_recent=4, **budget)
    assert cache.full_layers == FULL
    kept = _full_kept(cache)
    assert sum(len(p) for heads in kept.values() for p in heads) < PROMPT * 4
    if "max_tokens" in budget:
        assert cache.mean_stored() == budget["max_tokens"]
    with kvsieve.sieve_attention(model):
        ours = [model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(PROMPT, ids.shape[1])]
    with masked_reference(model, ids[:, :PROMPT], kept) as reference:
        expected = [
            model(ids[:, t : t + 1], past_key_values=reference.cache).logits for t in range(PROMPT, ids.shape[1])
        ]
    torch.testing.assert_close(torch.cat(ours, 1), torch.cat(expected, 1), atol=1e-4, rtol=0)
    with masked_reference(model, ids[:, :PROMPT], {}) as unmasked:
        whole = model(ids[:, PROMPT:], past_key_values=unmasked.cache).logits
    assert (whole - torch.cat(ours, 1)).abs().max() > 1e-3, "eviction should change the continuation"


@pytest.mark.parametrize("spec", ["snapkv", "h2o"])  # h2o: attention summed online in the full layers only
@torch.no_grad()
def test_bounded_generation_holds_the_budget_and_the_windows(masked_reference, spec):
    """Over many steps the full layers stay at budget + buffer and the sliding layers at their window; every step
    equals the masked reference of what was kept before it."""
    model, ids = tiny_gemma3(), _ids(3, PROMPT + 80)
    budget, buffer = 24, 8
    cache = kvsieve.compress(model, ids[:, :PROMPT], spec, max_tokens=budget, buffer=buffer, n_recent=4)
    reference = masked_reference(model, ids[:, :PROMPT], _full_kept(cache))
    evictions = 0
    for t in range(PROMPT, ids.shape[1]):
        before = cache.mean_stored()
        with kvsieve.sieve_attention(model):
            ours = model(ids[:, t : t + 1], past_key_values=cache).logits
        evictions += cache.mean_stored() < before
        assert cache.mean_stored() <= budget + buffer
        for layer in (0, 2):
            assert cache.stored_lengths()[layer] == [WINDOW - 1] * 2
            assert torch.equal(cache.kept_positions(layer)[0], torch.arange(t + 2 - WINDOW, t + 1))
        with reference:
            reference.allow(_full_kept(cache))
            expected = model(ids[:, t : t + 1], past_key_values=reference.cache).logits
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    assert evictions == 9, "evicted back to the budget once every `buffer` steps (steps 8, 16, ..., 72)"


@torch.no_grad()
def test_bytes_count_every_layer_and_a_byte_budget_reserves_the_windows():
    model, ids = tiny_gemma3(), _ids(4, 120, rows=2)
    entry = 2 * 16 * 4  # key + value of head_dim 16, float32
    for cache in (kvsieve.compress(model, ids, "snapkv", rate=0.7), kvsieve.compress(model, ids, "knorm+global", 0.5)):
        entries = sum(sum(heads) for row in range(2) for heads in cache.stored_lengths(row))
        assert cache.nbytes() == entries * entry
        assert cache.row_nbytes(0) + cache.row_nbytes(1) == cache.nbytes()
        assert sum(sum(cache.stored_lengths(0)[layer]) for layer in (0, 2)) * entry == cache.window_nbytes()
    window = 2 * 2 * (WINDOW - 1) * entry  # two sliding layers x two kv-heads at their window, per sequence
    for max_bytes in (window + 4 * 30 * entry, window + 4 * 30 * entry + entry - 1):
        cache = kvsieve.compress(model, ids, "snapkv+adaptive", max_bytes=max_bytes, n_recent=4)
        assert [cache.row_nbytes(row) for row in range(2)] == [window + 4 * 30 * entry] * 2
        assert cache.mean_stored() == 30
    smallest = window + 4 * entry
    assert kvsieve.compress(model, ids[:, :40], "snapkv", max_bytes=smallest, n_recent=0, n_sink=0).mean_stored() == 1
    too_small = rf"max_bytes={smallest - 1} does not fit what is set aside first .*sliding-window"
    with pytest.raises(kvsieve.PolicyError, match=too_small):
        kvsieve.compress(model, ids, "snapkv", max_bytes=smallest - 1, n_recent=0, n_sink=0)
    with pytest.raises(kvsieve.PolicyError, match=rf"\({window} bytes per sequence.*{smallest} bytes at least"):
        kvsieve.compress(model, ids, "snapkv", max_bytes=window // 2)


@torch.no_grad()
def test_bounded_generation_under_a_byte_budget_stays_within_it():
    model, ids = tiny_gemma3(), _ids(5, PROMPT + 60)
    entry, window = 2 * 16 * 4, 2 * 2 * (WINDOW - 1) * 2 * 16 * 4
    max_bytes, buffer = window + 4 * 24 * entry, 8
    cache = kvsieve.compress(model, ids[:, :PROMPT], "tova", max_bytes=max_bytes, buffer=buffer, n_recent=4)
    with kvsieve.sieve_attention(model):
        for t in range(PROMPT, ids.shape[1]):
            model(ids[:, t : t + 1], past_key_values=cache)
            assert cache.row_nbytes(0) <= max_bytes + 4 * buffer * entry
    assert cache.mean_stored() <= 24 + buffer


@torch.no_grad()
def test_a_padded_batch_equals_each_prompt_alone():
    """Left padding: the sliding layers hold the pads of the short row (masked, as transformers does), the full
    layers drop them; every row decodes as if compressed alone."""
    model, ids = tiny_gemma3(), _ids(6, PROMPT + 6, rows=2)
    mask = torch.ones_like(ids)
    mask[1, :30] = 0  # 10 real prompt tokens: row 1's sliding layers hold 5 pads and 10 tokens
    gen = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False}
    batch = kvsieve.compress(
        model, ids[:, :PROMPT], "snapkv:window=8", 0.6, attention_mask=mask[:, :PROMPT], n_recent=4
    )
    assert batch.stored_lengths(1)[0] == [WINDOW - 1] * 2 and batch.stored_lengths(1)[1] == [7, 7]
    with kvsieve.sieve_attention(model):
        out = model.generate(ids, attention_mask=mask, past_key_values=batch, **gen)
    for row, start in ((0, 0), (1, 30)):
        alone = kvsieve.compress(model, ids[row : row + 1, start:PROMPT], "snapkv:window=8", 0.6, n_recent=4)
        with kvsieve.sieve_attention(model):
            single = model.generate(ids[row : row + 1, start:], past_key_values=alone, **gen)
        assert torch.equal(out[row, start:], single[0])


@torch.no_grad()
def test_copies_row_selection_and_observations_cover_the_right_layers():
    model, ids = tiny_gemma3(), _ids(7, 60, rows=2)
    cache = kvsieve.compress(model, ids, "knorm+adaptive", 0.5)
    copy = cache.copy(rows=[1, 1, 0])
    assert copy.batch_size == 3 and copy.stored_lengths(0) == cache.stored_lengths(1)
    for layer in range(4):
        pairs = zip(copy.kept_positions(layer, 2), cache.kept_positions(layer, 0), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
    torch.testing.assert_close(copy.layers[0].keys[2], cache.layers[0].keys[0], atol=0, rtol=0)
    assert copy.layers[0].allocated_nbytes() == copy.layers[0].nbytes(), "a copied window holds only its entries"
    observations = kvsieve.observe_cache(model, cache, row=1)
    assert [o.layer_idx for o in observations] == FULL and all(o.num_layers == 4 for o in observations)
    assert observations[0].scaling == 24**-0.5
    prefill = kvsieve.observe_prefill(model, ids, kvsieve.Needs(window=4, accumulated=True))
    assert [o.layer_idx for o in prefill.observations[0]] == FULL
    with pytest.raises(ValueError, match="need keep indices for 2 full-attention layers in row 0, got 4"):
        cache.keep([[[torch.arange(2)] * 2] * 4] * 2)


def test_what_stays_unsupported_is_named():
    gemma2 = Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
    )
    with pytest.raises(
        kvsieve.UnhookableModelError, match=r"soft-caps its attention logits \(attn_logit_softcapping=50"
    ):
        kvsieve.compress(gemma2, _ids(8, 40), "snapkv", 0.5)
    chunked = tiny_llama(layers=2)
    chunked.config.layer_types = ["chunked_attention", "full_attention"]
    chunked.config.attention_chunk_size = 8
    chunked_error = r"chunked attention layers \(attention_chunk_size=8\)"
    with pytest.raises(kvsieve.UnhookableModelError, match=chunked_error), kvsieve.sieve_attention(chunked):
        pass


@torch.no_grad()
def test_a_cache_not_built_for_the_model_is_refused_once_evicted():
    """A SievedCache() stores every layer as evictable; evicting a sliding layer of it is refused, by name."""
    model, ids = tiny_gemma3(), _ids(9, 50)
    cache = kvsieve.SievedCache()
    with kvsieve.sieve_attention(model):
        model(ids[:, :40], past_key_values=cache)
    assert cache.full_layers == [0, 1, 2, 3]
    cache.evict([[[torch.arange(0, 40, 2)] * 2] * 4])
    refused = pytest.raises(kvsieve.UnsupportedAttentionError, match=r"SievedCache.for_model\(model\)")
    with refused, kvsieve.sieve_attention(model):
        model(ids[:, 40:41], past_key_values=cache)


@torch.no_grad()
def test_a_bounded_cache_built_empty_holds_its_budget_on_a_stream():
    model, ids = tiny_gemma3(), _ids(10, 160)
    cache = kvsieve.bounded_cache(model, "knorm", max_tokens=24, buffer=8, n_recent=4)
    assert [type(layer).__name__ for layer in cache.layers] == ["SlidingLayer", "SievedLayer"] * 2
    with kvsieve.sieve_attention(model):
        for start in range(0, 160, 8):
            model(ids[:, start : start + 8], past_key_values=cache)
            assert cache.mean_stored() <= 24 + 8
            assert cache.stored_lengths()[0] == [min(start + 8, WINDOW - 1)] * 2
    assert cache.get_seq_length() == 160


@torch.no_grad()
def test_routing_diagnostics_read_the_full_layers():
    """Survival and the routing diagnostics cover the layers the policy evicts, as its observations do."""
    model, ids = tiny_gemma3(), _ids(11, 60)
    prefill = kvsieve.observe_prefill(model, ids, kvsieve.Needs(window=8))
    cache = evictions(prefill, [Eviction("snapkv:window=8", 0.7, None)])
    survival = survival_from_cache(cache, 60)
    assert survival.shape == (2, 2, 60)
    assert survival.sum(-1).tolist() == [[len(p) for p in cache.kept_positions(layer)] for layer in FULL]
    assert diagnose(prefill.observations[0], survival, [10, 11]).evidence_tokens == 2
