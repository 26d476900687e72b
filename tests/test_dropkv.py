"""DropKV and the input it declares (each window query's attention output), against eager references.

At the prefill the score is checked against brute-force removal on the plain eager model; the recorded outputs
against the outputs `o_proj` received. While a bounded cache decodes, the logged outputs are what `o_proj`
received at each step until an eviction, and after one the outputs over the entries the cache then holds.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvsieve
from conftest import tiny_llama
from kvsieve.selection.observation import Needs
from kvsieve.selection.scorers.dropkv import ATTENTION_OUTPUTS

N = 64  # context length of the reference prefill
W = 4  # window


@pytest.fixture
def model():
    """`tiny_llama()` with sharper attention, so wrong formulas show in the scores."""
    model = tiny_llama()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    return model


class OutputTap:
    """Every attention output `[heads, q, d]` each layer's `o_proj` receives (a forward pre-hook), in order."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.heads = model.config.num_attention_heads
        self.seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(model.model.layers))}
        self.hooks = [
            layer.self_attn.o_proj.register_forward_pre_hook(self._hook(i))
            for i, layer in enumerate(model.model.layers)
        ]

    def _hook(self, layer: int):
        def record(module, args):
            self.seen[layer].append(args[0][0].unflatten(-1, (self.heads, -1)).transpose(0, 1).float())

        return record

    def last(self, layer: int, count: int) -> torch.Tensor:
        """The outputs of the last `count` queries of `layer`: `[heads, count, d]`."""
        return torch.cat(self.seen[layer], dim=1)[:, -count:]

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


@torch.no_grad()
def test_dropkv_matches_brute_force_removal_and_records_the_eager_outputs(model, ids):
    """dropkv = sum over the last W queries of ||o - o without key j||^2, renormalising the eager softmax."""
    observations = kvsieve.observe_prefill(model, ids[:, :N], Needs(window=W, measures=(ATTENTION_OUTPUTS,)))
    model.set_attn_implementation("eager")
    tap = OutputTap(model)
    cache = DynamicCache()
    attentions = model(ids[:, :N], past_key_values=cache, output_attentions=True).attentions
    tap.close()
    kv = model.config.num_key_value_heads
    group = model.config.num_attention_heads // kv
    for layer, obs in enumerate(observations.observations[0]):
        probs = attentions[layer][0, :, -W:].double()  # [heads, W, n]
        values = cache.layers[layer].values[0].double().repeat_interleave(group, dim=0)
        output = probs @ values
        torch.testing.assert_close(obs.measured(ATTENTION_OUTPUTS, W), tap.last(layer, W), atol=1e-5, rtol=1e-5)
        change = torch.zeros(probs.shape, dtype=torch.float64)
        keep = 1.0 - torch.eye(N, dtype=torch.float64)
        for i in range(W):
            visible = N - W + i + 1
            without = probs[:, i, None, :visible] * keep[None, :visible, :visible]
            without = without / without.sum(dim=-1, keepdim=True)
            change[:, i, :visible] = (output[:, i, None] - without @ values[:, :visible]).square().sum(dim=-1)
        expected = change.sum(dim=1).unflatten(0, (kv, group)).sum(dim=1)
        got = kvsieve.make_policy(f"dropkv:window={W}").scorer.score(obs)
        torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-4)


def _outputs_over_held_entries(obs: kvsieve.Observation) -> torch.Tensor:
    """`[q_heads, W, d]` the window queries' outputs over the entries `obs` holds: the eager softmax, float64."""
    queries, positions = obs.queries(W)
    keys, values, at, valid = (
        t.repeat_interleave(obs.group, dim=0)
        for t in (obs.keys.double(), obs.values.double(), obs.positions, obs.valid_mask)
    )
    logits = (queries.double() @ keys.transpose(1, 2)) * obs.scaling
    hidden = (at[:, None, :] > positions[None, :, None]) | ~valid[:, None, :]
    return torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1) @ values


@torch.no_grad()
def test_a_bounded_cache_keeps_the_outputs_valid_while_decoding_and_after_evictions(model, ids):
    """Every step's output is what `o_proj` received; after every step, evictions included, the logged outputs are
    each window query's output over the entries the cache holds, which is what the score reads."""
    cache = kvsieve.compress(model, ids[:, :60], "dropkv", max_tokens=40, buffer=8, window=W)
    log = cache.growth.queries
    tap = OutputTap(model)
    evictions = 0
    with kvsieve.sieve_attention(model):
        for t in range(60, 100):
            before = cache.mean_stored()
            model(ids[:, t : t + 1], past_key_values=cache)
            evictions += cache.mean_stored() < before
            assert torch.equal(log.positions[0][0], torch.arange(t - W + 1, t + 1))
            for layer, obs in enumerate(cache.growth.observations(cache, 0)):
                held = obs.measured(ATTENTION_OUTPUTS, W)
                torch.testing.assert_close(held[:, -1:], tap.last(layer, 1), atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(held.double(), _outputs_over_held_entries(obs), atol=1e-5, rtol=1e-5)
    tap.close()
    assert evictions >= 4


@torch.no_grad()
def test_dropkv_decodes_like_the_masked_reference(model, ids, masked_reference):
    cache = kvsieve.compress(model, ids[:, :100], "dropkv+adaptive", 0.7)
    kept = [cache.kept_positions(layer) for layer in range(3)]
    with kvsieve.sieve_attention(model):
        ours = model(ids[:, 100:], past_key_values=cache).logits
    with masked_reference(model, ids[:, :100], kept) as ref:
        expected = model(ids[:, 100:], past_key_values=ref.cache).logits
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_a_cache_rescored_without_the_outputs_names_what_is_missing(model, ids):
    cache = kvsieve.compress(model, ids[:, :60], "snapkv", 0.5)
    observation = kvsieve.observe_cache(model, cache)[0]
    with pytest.raises(ValueError, match="window=4 needs the last 4 queries' attention_outputs; 0 were recorded"):
        kvsieve.make_policy("dropkv:window=4").scorer.score(observation)
    with pytest.raises(ValueError, match="query measures are recorded for the last `window` queries"):
        Needs(measures=(ATTENTION_OUTPUTS,))
