"""Merges (`kvsieve.selection.merge`): what a head evicts lives on as one entry with a logit bias."""

from __future__ import annotations

import math

import pytest
import torch

import kvsieve
from conftest import tiny_gemma3, tiny_llama
from kvsieve.kernels.attention import merged_sdpa, reference_attention
from kvsieve.runtime.api.evictions import Eviction, evictions
from kvsieve.runtime.observing.prefill import observe_prefill
from kvsieve.runtime.storage.merged import MergedEntries
from kvsieve.selection.errors import PolicyError
from kvsieve.selection.merge import MeanMerge, OutputMerge, WindowMerge, merge_evicted
from kvsieve.selection.observation import QUERIES, LayerFacts, Observation, Statistics
from kvsieve.selection.spec import make_policy
from kvsieve.vllm.settings import unservable

GEN = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}


def observation(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, scaling: float = 0.25) -> Observation:
    """One layer of `keys`/`values [kv_heads, n, d]`, its last `w` queries `[q_heads, w, d]` at the last positions."""
    n, w = keys.shape[1], queries.shape[1]
    positions = torch.arange(n).expand(keys.shape[0], n)
    stats = Statistics(window={QUERIES.name: queries}, window_positions=torch.arange(n - w, n))
    return Observation(0, 1, keys, values, positions, None, LayerFacts(scaling, queries.shape[0]), stats)


def merged_columns(cache) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Row 0's merged entry of every layer, as the masked reference takes them (`MaskedReference(merged=)`)."""
    return {
        i: (layer.merged.keys[0], layer.merged.values[0], layer.merged.bias[0]) for i, layer in enumerate(cache.layers)
    }


def assert_attends_as_all(merged, keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor, query: torch.Tensor):
    """`query` over the `kept` entries plus the merged ones gives its attention over every entry (scale 0.25)."""
    entries = MergedEntries(merged.keys[None], merged.values[None], merged.bias[None])
    ours = merged_sdpa(query, keys[None, :, kept], values[None, :, kept], None, entries, 0.25)
    full = reference_attention(query, keys[None], values[None], None, 0.25)
    torch.testing.assert_close(ours, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("merge", [MeanMerge(), WindowMerge(), OutputMerge()])
def test_merged_entry_of_equal_keys_is_exact(merge):
    """Evicted entries sharing one key get equal weights under every query: one merged entry with the bias log n
    gives exactly the attention over all of them (float64 reference, every entry visible)."""
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 40, 16, generator=gen), torch.randn(2, 40, 16, generator=gen)
    evicted = torch.arange(5, 25)
    keys[:, evicted] = keys[:, 5:6]
    obs = observation(keys, values, torch.randn(4, 8, 16, generator=gen))
    kept = [torch.cat([torch.arange(5), torch.arange(25, 40)])] * 2
    merged = merge_evicted(merge, obs, kept)
    torch.testing.assert_close(merged.bias, torch.full((2, 1), math.log(20)), atol=1e-5, rtol=0)
    assert_attends_as_all(merged, keys, values, kept[0], torch.randn(1, 4, 3, 16, generator=gen))


@pytest.mark.parametrize("merge", [MeanMerge(parts=2), WindowMerge(parts=2)])
def test_two_parts_merge_two_groups_of_equal_keys_exactly(merge):
    """Evicted entries sharing one of two keys fall into two groups (`key_groups`), each merged exactly: the two
    merged entries give exactly the attention over all of them; a head evicting one entry holds one."""
    gen = torch.Generator().manual_seed(4)
    keys, values = torch.randn(1, 40, 16, generator=gen), torch.randn(1, 40, 16, generator=gen)
    evicted = torch.arange(5, 25)
    keys[:, evicted[::2]], keys[:, evicted[1::2]] = keys[:, 1:2].clone(), keys[:, 2:3].clone()
    obs = observation(keys, values, torch.randn(2, 8, 16, generator=gen))
    kept = [torch.cat([torch.arange(5), torch.arange(25, 40)])]
    merged = merge_evicted(merge, obs, kept)
    torch.testing.assert_close(merged.bias, torch.full((1, 2), math.log(10)), atol=1e-5, rtol=0)
    assert_attends_as_all(merged, keys, values, kept[0], torch.randn(1, 2, 3, 16, generator=gen))
    one = merge_evicted(merge, obs, [torch.cat([torch.arange(5), torch.arange(6, 40)])])
    assert torch.isfinite(one.bias).tolist() == [[True, False]]


def test_window_merge_follows_the_window_queries():
    """Weights: the window queries' softmax over the evicted entries, averaged; bias: their log-sum-exp less the
    merged logit, averaged (an independent float64 computation); a query does not weigh keys after its position."""
    gen = torch.Generator().manual_seed(1)
    keys, values = torch.randn(1, 30, 8, generator=gen), torch.randn(1, 30, 8, generator=gen)
    queries = torch.randn(2, 4, 8, generator=gen)  # two query heads share the kv-head, positions 26..29
    obs = observation(keys, values, queries, scaling=0.5)
    kept = [torch.arange(0, 20)]
    evicted = torch.arange(20, 30)
    merged = merge_evicted(WindowMerge(), obs, kept)
    q, k = queries.reshape(-1, 8).double(), keys[0, evicted].double()
    logits = (q @ k.T) * 0.5
    later = evicted[None, :] > torch.arange(26, 30).repeat(2)[:, None]
    unmasked = torch.softmax(logits, -1).mean(0)
    logits = logits.masked_fill(later, float("-inf"))
    weights = torch.softmax(logits, -1).mean(0)
    assert (weights - unmasked).abs().max() > 1e-2
    key = weights @ k
    bias = (torch.logsumexp(logits, -1) - (q @ key) * 0.5).mean()
    torch.testing.assert_close(merged.keys[0, 0].double(), key, atol=1e-5, rtol=0)
    torch.testing.assert_close(merged.values[0, 0].double(), weights @ values[0, evicted].double(), atol=1e-5, rtol=0)
    assert abs(float(merged.bias[0, 0]) - float(bias)) < 1e-4


def window_output_error(obs: Observation, kept: torch.Tensor, merged: tuple[torch.Tensor, ...], bias: float) -> float:
    """Float64: the window queries' mean squared difference between attending to all of kv-head 0's entries and
    to the `kept` ones plus the merged entry (key, value) with `bias` (-inf: no merged entry)."""
    queries = obs.stats.window_queries.reshape(-1, obs.keys.shape[-1]).double()
    positions = obs.stats.window_positions.repeat(obs.group)
    keys, values = obs.keys[0].double(), obs.values[0].double()
    logits = (queries @ keys.T) * obs.scaling
    logits = logits.masked_fill(torch.arange(keys.shape[0])[None, :] > positions[:, None], float("-inf"))
    before = torch.softmax(logits, -1) @ values
    merged_logit = (queries @ merged[0].double()) * obs.scaling + bias
    weights = torch.softmax(torch.cat([logits[:, kept], merged_logit[:, None]], -1), -1)
    after = weights @ torch.cat([values[kept], merged[1].double()[None]])
    return float((after - before).square().sum(-1).mean())


def test_output_merge_reproduces_the_window_outputs_best():
    """`OutputMerge` keeps `WindowMerge`'s key and value; its bias gives the window queries' outputs a smaller error
    than `WindowMerge`'s, than none, and than its neighbours on the searched grid (float64, computed apart)."""
    gen = torch.Generator().manual_seed(2)
    keys, values = torch.randn(1, 48, 8, generator=gen), 3 * torch.randn(1, 48, 8, generator=gen)
    obs = observation(keys, values, torch.randn(2, 6, 8, generator=gen), scaling=0.5)
    kept = [torch.cat([torch.arange(4), torch.arange(30, 48)])]
    window, output = merge_evicted(WindowMerge(), obs, kept), merge_evicted(OutputMerge(), obs, kept)
    torch.testing.assert_close(output.keys, window.keys)
    torch.testing.assert_close(output.values, window.values)
    entry, bias = (output.keys[0, 0], output.values[0, 0]), float(output.bias[0, 0])
    assert bias < float(window.bias[0, 0]), "values that disagree should lower the bias"
    error = window_output_error(obs, kept[0], entry, bias)
    for other in (float(window.bias[0, 0]), float("-inf"), bias - 0.125, bias + 0.125):
        assert error < window_output_error(obs, kept[0], entry, other)


@pytest.mark.parametrize(
    "spec",
    [
        "snapkv:merge=window",
        "trimkv+global:gates=untrained,merge=mean",
        "snapkv+global:merge=window",
        "snapkv+global:merge=output",
        "snapkv+global:merge=window,parts=3",
    ],
)
@torch.no_grad()
def test_merged_cache_equals_masked_full_cache_with_the_merged_column(model, ids, masked_reference, spec):
    """A compressed, merged cache == the full cache masking the dropped entries, plus each head's merged entry."""
    prefix, cont = ids[:, :90], ids[:, 90:]
    cache = kvsieve.compress(model, prefix, spec, 0.7, n_recent=8)
    kept = [cache.kept_positions(layer) for layer in range(3)]
    merged = merged_columns(cache)
    assert all(bool(torch.isfinite(bias).all()) for _, _, bias in merged.values())
    with kvsieve.sieve_attention(model):
        ours = model(cont, past_key_values=cache).logits
        step = model(cont[:, :1], past_key_values=kvsieve.compress(model, prefix, spec, 0.7, n_recent=8)).logits
    with masked_reference(model, prefix, kept, merged=merged) as ref:
        expected = model(cont, past_key_values=ref.cache).logits
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(step[:, 0], expected[:, 0], atol=1e-4, rtol=0)  # a decoding step (additive mask)
    with masked_reference(model, prefix, kept) as ref:
        unmerged = model(cont, past_key_values=ref.cache).logits
    assert (unmerged - ours).abs().max() > 1e-3, "the merged entries should change the continuation"


@torch.no_grad()
def test_merged_generate_equals_the_reference(model, ids, masked_reference):
    prefix = ids[:, :100]
    cache = kvsieve.compress(model, prefix, "snapkv:merge=window", 0.7, n_recent=8)
    kept = [cache.kept_positions(layer) for layer in range(3)]
    merged = merged_columns(cache)
    with kvsieve.sieve_attention(model):
        ours = model.generate(ids, past_key_values=cache, **GEN)
    with masked_reference(model, prefix, kept, merged=merged) as ref:
        expected = model.generate(ids, past_key_values=ref.cache, **GEN)
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("budget", [{"rate": 0.6}, {"max_tokens": 40}])
def test_the_merged_entry_takes_a_kept_slot(model, ids, budget):
    """Under one budget a merging policy holds as many entries (merged ones counted) and as many bytes."""
    plain = kvsieve.compress(model, ids, "snapkv", **budget)
    merged = kvsieve.compress(model, ids, "snapkv:merge=mean", **budget)
    assert merged.nbytes() == plain.nbytes()
    lengths = [[n + 1 for n in heads] for heads in merged.stored_lengths()]
    assert lengths == plain.stored_lengths()


@torch.no_grad()
def test_rows_keep_their_own_merged_entries(model, ids):
    """Copied rows carry their merged entries; a row that merges nothing reads no merged column."""
    cache = kvsieve.compress(model, ids[:, :90], "snapkv:merge=window", 0.7)
    twice = cache.copy(rows=[0, 0])
    cont = ids[:, 90:95]
    with kvsieve.sieve_attention(model):
        one = model(cont, past_key_values=cache).logits
        two = model(cont.expand(2, -1), past_key_values=twice).logits
    torch.testing.assert_close(two, one.expand(2, -1, -1), atol=1e-5, rtol=0)
    assert twice.nbytes() == 2 * cache.nbytes()
    nothing = kvsieve.compress(model, ids[:, :90], "snapkv:merge=window", 0.0)
    assert all(layer.merged is None for layer in nothing.layers)


@torch.no_grad()
def test_rows_of_other_merges_share_one_cache(model, ids):
    """Prefill once, sieve many: rows merging into 3 parts, 1 part and nothing read what each compressed alone does."""
    specs = ["snapkv:merge=window,parts=3", "snapkv:merge=mean", None]
    prefill = observe_prefill(model, ids[:, :90], make_policy("snapkv:merge=window").needs)
    rows = evictions(prefill, [Eviction(spec, 0.7) for spec in specs])
    cont = ids[:, 90:95]
    with kvsieve.sieve_attention(model):
        together = model(cont.expand(3, -1), past_key_values=rows).logits
        for row, spec in enumerate(specs):
            alone = kvsieve.compress(model, ids[:, :90], spec or "snapkv", 0.7 if spec else 0.0)
            torch.testing.assert_close(together[row], model(cont, past_key_values=alone).logits[0], atol=1e-5, rtol=0)


@torch.no_grad()
def test_gemma_merges_its_full_attention_layers_only():
    model = tiny_gemma3()
    ids = torch.randint(0, 64, (1, 60), generator=torch.Generator().manual_seed(3))
    cache = kvsieve.compress(model, ids[:, :50], "snapkv:merge=window", 0.6)
    assert [
        i for i, layer in enumerate(cache.layers) if getattr(layer, "merged", None) is not None
    ] == cache.full_layers
    with kvsieve.sieve_attention(model):
        out = model(ids[:, 50:], past_key_values=cache).logits
    assert bool(torch.isfinite(out).all())


def test_merge_names_and_refusals(model, ids):
    assert make_policy("trimkv+global:merge=window").name == "trimkv+global:merge=window"
    assert make_policy("snapkv", merge="mean").name == "snapkv:merge=mean"
    assert make_policy("snapkv:merge=window").needs.window == max(make_policy("snapkv").needs.window, 32)
    with pytest.raises(PolicyError, match=r"unknown merge .sum.; known: mean, window, output, none"):
        make_policy("snapkv:merge=sum")
    assert make_policy("snapkv:merge=window,parts=4").name == "snapkv:merge=window,parts=4"
    for bad, message in (("merge=window,parts=0", "whole number >= 1"), ("parts=2", "the policy names none")):
        with pytest.raises(PolicyError, match=message):
            make_policy(f"snapkv:{bad}")
    with pytest.raises(PolicyError, match="summarize one eviction of a prompt"):
        kvsieve.compress(model, ids, "snapkv:merge=window", max_tokens=40, buffer=8)
    assert not unservable(make_policy("snapkv:merge=window"))  # vLLM serves it (kvsieve's attention adds the bias)


def test_a_layer_merges_once(model, ids):
    cache = kvsieve.compress(model, ids, "snapkv:merge=mean", 0.5)
    with pytest.raises(ValueError, match="already holds merged entries"):
        cache.layers[0].merge([None])


def test_llama_in_float64_merges_the_same(ids):
    """The merge is computed in float32 and stored in the model's dtype: a float64 model holds float64 entries."""
    model = tiny_llama().double()
    cache = kvsieve.compress(model, ids[:, :90], "snapkv:merge=window", 0.7)
    assert cache.layers[0].merged.keys.dtype == torch.float64
