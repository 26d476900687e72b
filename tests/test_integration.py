"""A few checks on the embedded default model (SmolLM2-135M-Instruct); kept small on purpose."""

from __future__ import annotations

import pytest
import torch

import kvsieve
from kvsieve.harness.data import sample_documents

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def default_model():
    return kvsieve.load_model()


@torch.no_grad()
def test_default_model_full_cache_matches_sdpa_and_compressed_generate_runs(default_model):
    model, tokenizer = default_model
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    _, ids = sample_documents(tokenizer, 1, 300, seed=1)[0]
    assert ids.shape == (1, 300) and ids[0, 0] == tokenizer.bos_token_id

    model.set_attn_implementation("sdpa")
    expected = model(ids).logits[0, 250:]
    prefill = kvsieve.observe_prefill(model, ids[:, :250])
    got = model(ids[:, 250:], past_key_values=prefill.cache).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)

    cache = kvsieve.compress(model, ids[:, :250], "importance", rate=0.8)
    assert model.config._attn_implementation == "sdpa", "compress gives the model its own attention back"
    kept = 250 - round(0.8 * (250 - 1 - 32))
    assert cache.stored_lengths() == [[kept] * 3] * 30
    assert cache.nbytes() == prefill.cache.nbytes() * kept // 300
    with kvsieve.sieve_attention(model):
        out = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 308)
    assert cache.get_seq_length() == 307

    ragged = kvsieve.compress(model, ids[:, :250], "snapkv+adaptive", rate=0.8)
    lengths = [n for layer in ragged.stored_lengths() for n in layer]
    assert len(set(lengths)) > 1 and sum(lengths) == 30 * 3 * kept
    entry = 2 * 64 * 4  # key + value, head_dim 64, float32
    assert ragged.nbytes() == sum(lengths) * entry
    assert ragged.allocated_nbytes() == ragged.nbytes() + 30 * entry, "exactly sized, plus one null entry per layer"


@torch.no_grad()
def test_default_model_h2o_generation_stays_bounded_and_starts_as_the_full_cache(default_model):
    """h2o with attention accumulated online: same logits until the first eviction, then held at the budget."""
    model, tokenizer = default_model
    _, ids = sample_documents(tokenizer, 1, 200, seed=2)[0]
    gen = {"max_new_tokens": 120, "min_new_tokens": 120, "do_sample": False, "pad_token_id": 0}
    gen |= {"output_scores": True, "return_dict_in_generate": True}
    model.set_attn_implementation("sdpa")
    plain = model.generate(ids, **gen)
    config = kvsieve.EvictionConfig(policy="h2o", max_tokens=256, buffer=32)
    with kvsieve.apply(model, config) as handle:
        bounded = model.generate(ids, **gen)
        cache = handle.last_cache
    # 199 prompt entries + 57 steps fit 256 + 32; the first eviction comes before step 90
    same = torch.stack(plain.scores[:80]).nan_to_num(neginf=0.0)
    torch.testing.assert_close(torch.stack(bounded.scores[:80]).nan_to_num(neginf=0.0), same, atol=2e-3, rtol=0)
    assert cache.get_seq_length() == 319 and 256 <= cache.mean_stored() <= 256 + 32
    assert cache.allocated_nbytes() > cache.nbytes(), "the attention sums are counted"


@torch.no_grad()
def test_shipped_gates_load_and_compress_the_default_model(default_model):
    """The trimkv checkpoint inside the package is found by the model's weights hash and evicts for real, folding
    what each head evicts into the merged entries its checkpoint records."""
    from kvsieve.selection.checkpoint import load_gates, read_gates, shipped_checkpoints, shipped_gates_for

    model, tokenizer = default_model
    names = [
        "gemma3-270m",
        "gemma3-270m-seed0",
        "smollm2-135m",
        "smollm2-135m-capacity128",
        "smollm2-135m-capacity32",
        "smollm2-135m-capacity32-varied",
    ]
    assert [folder.name for folder in shipped_checkpoints()] == names
    record = read_gates(shipped_gates_for(model))[1]
    members = [member["train"] for member in record.data["ensemble"]]
    recipe = {(m["capacity"], m["data"]["config"]["tasks"]) for m in members}
    assert recipe == {(32, "ruler,routing,varied")} and [m["seed"] for m in members] == [0, 1, 2, 3, 4], "issue 39"
    gates = load_gates("default", model)
    seed0 = load_gates("smollm2-135m-capacity32-varied", model)
    assert gates.shape.width == 5 * seed0.shape.width, "the default: five seeds of one recipe side by side"
    for name in names[3:]:  # the gates it replaced, by name
        assert load_gates(name, model).shape.width != gates.shape.width
    assert gates.shape.layers == tuple(range(30)) and (gates.shape.kv_heads, gates.shape.head_dim) == (3, 64)
    _, ids = sample_documents(tokenizer, 1, 400, seed=2)[0]
    full = kvsieve.observe_prefill(model, ids[:, :-1]).cache.nbytes()
    cache = kvsieve.compress(model, ids[:, :-1], "trimkv+global", rate=0.8)
    evictable = 399 - 1 - 32
    kept = sum(n - 33 for layer in cache.stored_lengths() for n in layer)
    budget = 90 * (evictable - round(0.8 * evictable))
    assert kept == budget - 90 * 4, "one global budget over 30 layers x 3 kv-heads, four slots a head for merges"
    merged = sum(int(torch.isfinite(layer.merged.bias).sum()) for layer in cache.layers)
    assert 0.95 * 90 * 4 <= merged <= 90 * 4, "the default gates record merge=window,parts=4: up to 4 a head"
    plain = kvsieve.compress(model, ids[:, :-1], "trimkv+global:merge=none", rate=0.8)
    assert all(layer.merged is None for layer in plain.layers), "merge=none: the default before the merge"
    assert sum(n - 33 for layer in plain.stored_lengths() for n in layer) == budget
    assert len({n for layer in cache.stored_lengths() for n in layer}) > 1, "layers and heads keep what they earn"
    assert cache.nbytes() < 0.4 * full
    with kvsieve.sieve_attention(model):
        out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 404)
