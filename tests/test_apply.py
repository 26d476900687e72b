"""The one-call interface: `apply` makes `generate` compress every prompt."""

from __future__ import annotations

import warnings

import pytest
import torch

import kvsieve

GEN = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}


@torch.no_grad()
def test_apply_compresses_each_prompt_and_matches_compress(model, ids):
    config = kvsieve.EvictionConfig(rate=0.8, policy="importance")
    with kvsieve.apply(model, config) as handle:
        out = model.generate(ids, **GEN)
        cache = handle.last_cache
        assert isinstance(cache, kvsieve.SievedCache)
        n_evictable = 119 - 1 - 32
        assert cache.stored_lengths()[0] == [119 - round(0.8 * n_evictable) + 6] * 2
    assert "generate" not in model.__dict__, "remove() gives the model its own generate back"
    assert model.config._attn_implementation == "sdpa", "and its own attention"
    manual = kvsieve.compress(model, ids[:, :-1], "importance", 0.8)
    with kvsieve.sieve_attention(model):
        assert torch.equal(model.generate(ids, past_key_values=manual, **GEN), out)


@torch.no_grad()
def test_apply_random_differs_from_importance(model, ids):
    outputs = {}
    for mode in ("importance", "random"):
        handle = kvsieve.apply(model, kvsieve.EvictionConfig(rate=0.9, policy=mode))
        model.generate(ids, **GEN)
        outputs[mode] = handle.last_cache.kept_positions(1)
        handle.remove()
    assert any(not torch.equal(a, b) for a, b in zip(outputs["importance"], outputs["random"], strict=True))


@torch.no_grad()
def test_short_prompts_pass_through(model, ids):
    with kvsieve.apply(model, kvsieve.EvictionConfig(rate=0.5)) as handle:
        model.generate(ids[:, :20], **GEN)
        assert handle.last_cache is None


@torch.no_grad()
def test_apply_with_a_budget_allocator(model, ids):
    config = kvsieve.EvictionConfig(rate=0.8, policy="snapkv", allocator="adaptive")
    with kvsieve.apply(model, config) as handle:
        out = model.generate(ids, **GEN)
        ragged = handle.last_cache.stored_lengths()
    manual = kvsieve.compress(model, ids[:, :-1], "snapkv", 0.8, allocator="adaptive")
    assert [[n + GEN["max_new_tokens"] for n in layer] for layer in manual.stored_lengths()] == ragged
    with kvsieve.sieve_attention(model):
        assert torch.equal(model.generate(ids, past_key_values=manual, **GEN), out)


@torch.no_grad()
def test_question_aware_compression(model, ids, masked_reference):
    """The question's queries drive the window scores, its entries are protected, and decoding stays exact."""
    context, question = ids[:, :90], ids[:, 90:110]
    aware = kvsieve.compress(model, context, "snapkv:window=20", 0.8, question_ids=question, n_recent=4)
    agnostic = kvsieve.compress(model, context, "snapkv:window=20", 0.8, n_recent=4)
    assert aware.get_seq_length() == 110 and agnostic.get_seq_length() == 90

    # reference: scores from the joint prefill, whose last 20 queries are exactly the question
    joint = kvsieve.observe_prefill(model, ids[:, :110], kvsieve.Needs(window=32))
    question_positions = torch.arange(90, 110)
    keep = kvsieve.make_policy("snapkv:window=20,n_recent=4").select(
        joint.observations[0], 0.8, protect_positions=torch.arange(86, 110)
    )
    for layer in range(3):
        for head, positions in enumerate(aware.kept_positions(layer)):
            assert torch.equal(positions, keep[layer][head])
            assert set(question_positions.tolist()) <= set(positions.tolist())
    # the agnostic cache keeps the same number of context entries, chosen from the context's own last queries
    context_kept = [[p[p < 90] for p in aware.kept_positions(layer)] for layer in range(3)]
    assert [[len(p) for p in layer] for layer in context_kept] == agnostic.stored_lengths()
    assert any(
        not torch.equal(a, b)
        for layer in range(3)
        for a, b in zip(context_kept[layer], agnostic.kept_positions(layer), strict=True)
    )

    answer = ids[:, 110:]
    with kvsieve.sieve_attention(model):
        ours = model(answer, past_key_values=aware).logits
    with masked_reference(model, ids[:, :110], [aware.kept_positions(layer) for layer in range(3)]) as ref:
        expected = model(answer, past_key_values=ref.cache).logits
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


@torch.no_grad()
def test_apply_compresses_every_row_of_a_padded_batch(model, ids):
    """A left-padded batch: each prompt is compressed with its own budget, and answers equal one-at-a-time apply."""
    config = kvsieve.EvictionConfig(rate=0.7, policy="snapkv+adaptive")
    batch = torch.stack([ids[0], torch.cat([torch.zeros(20, dtype=torch.long), ids[0, :100]])])
    mask = torch.ones_like(batch)
    mask[1, :20] = 0
    with kvsieve.apply(model, config) as handle:
        out = model.generate(batch, attention_mask=mask, **GEN)
        lengths = [handle.last_cache.stored_lengths(row) for row in range(2)]
        alone = [model.generate(ids, **GEN), model.generate(ids[:, :100], **GEN)]
        alone_lengths = [handle.last_cache.stored_lengths()]
    assert torch.equal(out[0], alone[0][0])
    assert torch.equal(out[1, -GEN["max_new_tokens"] :], alone[1][0, -GEN["max_new_tokens"] :])
    assert lengths[1] == alone_lengths[0] and lengths[0] != lengths[1]


@torch.no_grad()
def test_generate_and_apply_share_one_rule_for_prompts_too_short_to_evict(model, ids):
    """Under a rate, a prompt with nothing evictable runs on the model's own cache in both entry points.

    Both pass generate an explicit mask (every prompt token real; token 0 is also the pad token here).
    """
    short, config = ids[:, :30], kvsieve.EvictionConfig(rate=0.5)
    plain = model.generate(short, attention_mask=torch.ones_like(short), **GEN)
    assert torch.equal(kvsieve.generate(model, short, "importance", 0.5, **GEN), plain)
    with kvsieve.apply(model, config) as handle:
        assert torch.equal(model.generate(short, **GEN), plain) and handle.last_cache is None
        # question-aware: the context is what is evicted; a long question does not make a short context evictable
        context, question = ids[:, :20], ids[:, 20:60]
        prompt = torch.cat([context, question], -1)
        joined = model.__class__.generate(model, prompt, attention_mask=torch.ones_like(prompt), **GEN)
        assert torch.equal(model.generate(context, question_ids=question, **GEN), joined)
        assert handle.last_cache is None
        with pytest.raises(kvsieve.PolicyError, match="beam search cannot run on a compressed cache"):
            model.generate(ids, num_beams=2, max_new_tokens=2, pad_token_id=0)
    assert torch.equal(kvsieve.generate(model, context, "importance", 0.5, question_ids=question, **GEN), joined)
    one_longer = ids[:, : 1 + 1 + 32 + 1]  # n_sink + n_recent + one evictable, then the token generate feeds
    assert kvsieve.generate(model, one_longer, "importance", 0.5, **GEN).shape[1] == one_longer.shape[1] + 6


@torch.no_grad()
def test_a_one_token_prompt_under_a_size_starts_from_an_empty_bounded_cache(model, ids):
    gen = {"max_new_tokens": 60, "min_new_tokens": 60, "do_sample": False, "pad_token_id": 0}
    with kvsieve.apply(model, kvsieve.EvictionConfig(policy="knorm", max_tokens=40, buffer=8)) as handle:
        out = model.generate(ids[:, :1], **gen)
        cache = handle.last_cache
    assert out.shape[1] == 61 and cache.get_seq_length() == 60 and cache.mean_stored() <= 40 + 8


@torch.no_grad()
def test_a_plain_forward_inside_apply_warns_once_that_it_is_not_compressed(model, ids):
    with kvsieve.apply(model, kvsieve.EvictionConfig(rate=0.5)), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(ids, **GEN)  # compressed: no warning
        model.generate(ids[:, :20], **GEN)  # too short to evict (the rule), inside generate: no warning
        cache = kvsieve.compress(model, ids[:, :-1], "snapkv", 0.5)
        model(ids[:, -1:], **kvsieve.cache_argument(model, cache))  # the user's own compressed cache: no warning
        assert not caught
        full = model(ids).logits
        model(ids)
    assert [type(w.message) for w in caught] == [kvsieve.UncompressedForwardWarning]
    assert "compresses the prompts of model.generate() only" in str(caught[0].message)
    torch.testing.assert_close(full, model(ids).logits)  # it ran on the full cache, as the warning says
    with warnings.catch_warnings(record=True) as after:
        warnings.simplefilter("always")
        model(ids)
    assert not after, "the hook goes with the handle"
