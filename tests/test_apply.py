"""The one-call interface: `apply` makes `generate` compress every prompt."""

from __future__ import annotations

import torch

import kvsieve

GEN = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}


@torch.no_grad()
def test_apply_compresses_each_prompt_and_matches_compress(model, ids):
    config = kvsieve.EvictionConfig(eviction_rate=0.8, eviction_mode="importance")
    with kvsieve.apply(model, config) as handle:
        out = model.generate(ids, **GEN)
        cache = handle.last_cache
        assert isinstance(cache, kvsieve.SievedCache)
        n_evictable = 119 - 1 - 32
        assert cache.stored_lengths()[0] == [119 - round(0.8 * n_evictable) + 6] * 2
    assert "generate" not in model.__dict__
    manual = kvsieve.compress(model, ids[:, :-1], "importance", 0.8)
    assert torch.equal(model.generate(ids, past_key_values=manual, **GEN), out)


@torch.no_grad()
def test_apply_random_differs_from_importance(model, ids):
    outputs = {}
    for mode in ("importance", "random"):
        handle = kvsieve.apply(model, kvsieve.EvictionConfig(eviction_rate=0.9, eviction_mode=mode))
        model.generate(ids, **GEN)
        outputs[mode] = handle.last_cache.kept_positions(1)
        handle.remove()
    assert any(not torch.equal(a, b) for a, b in zip(outputs["importance"], outputs["random"], strict=True))


@torch.no_grad()
def test_short_prompts_pass_through(model, ids):
    with kvsieve.apply(model, kvsieve.EvictionConfig(eviction_rate=0.5)) as handle:
        model.generate(ids[:, :20], **GEN)
        assert handle.last_cache is None
