"""The transformers contracts kvsieve honours, its scoping, kvpress side by side, and one attention call per layer."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.utils import logging as hf_logging

import kvsieve
from conftest import tiny_llama
from kvsieve.runtime.storage.cache import SievedLayer
from kvsieve.selection.policy import Policy

TESTS = Path(__file__).parent


@torch.no_grad()
def test_layers_are_updated_through_their_own_update_and_return_tensors(model, ids, monkeypatch):
    calls = []
    original = SievedLayer.update

    def spy(self, key_states, value_states, *args, **kwargs):
        keys, values = original(self, key_states, value_states, *args, **kwargs)
        calls.append((type(keys), tuple(keys.shape), type(values)))
        return keys, values

    monkeypatch.setattr(SievedLayer, "update", spy)
    cache = kvsieve.compress(model, ids[:, :100], "snapkv+adaptive", 0.5)
    assert len(calls) == 3 and all(k is torch.Tensor and v is torch.Tensor for k, _, v in calls)
    calls.clear()
    with kvsieve.sieve_attention(model):
        model(ids[:, 100:104], past_key_values=cache)
    widest = [max(layer.segments.capacity) for layer in cache.layers]
    assert [shape for _, shape, _ in calls] == [(1, 2, n, 16) for n in widest], "padded to the widest room"
    assert all(n < 104 for n in widest), "evicted entries take no room"
    assert cache.get_seq_length() == 104
    assert cache.get_mask_sizes(torch.arange(104, 107), 0) == (107, 0), "masks cover the logical sequence"


@torch.no_grad()
def test_plain_caches_under_sieve_attention_are_exactly_sdpa(model, ids):
    model.set_attn_implementation("sdpa")
    expected = [model(ids, past_key_values=DynamicCache()).logits, model(ids).logits]
    with kvsieve.sieve_attention(model):
        got = [model(ids, past_key_values=DynamicCache()).logits, model(ids).logits]
        prefill = kvsieve.observe_prefill(model, ids[:, :60])
        cont = model(ids[:, 60:], past_key_values=prefill.cache).logits
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    torch.testing.assert_close(cont, expected[0][:, 60:], atol=1e-5, rtol=0)


def test_switching_to_sieve_attention_is_scoped(model, ids):
    model.set_attn_implementation("eager")
    kvsieve.compress(model, ids, "importance", 0.5)
    assert model.config._attn_implementation == "eager"
    with kvsieve.sieve_attention(model):
        with kvsieve.sieve_attention(model):
            assert model.config._attn_implementation == "sieve"
        assert model.config._attn_implementation == "sieve", "an inner block leaves the outer one on"
    assert model.config._attn_implementation == "eager"
    with pytest.raises(RuntimeError, match="boom"), kvsieve.sieve_attention(model):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "eager"


def test_apply_leaves_nothing_behind(model, ids):
    model.set_attn_implementation("sdpa")
    handle = kvsieve.apply(model, kvsieve.EvictionConfig(rate=0.5))
    assert "generate" in model.__dict__ and model.config._attn_implementation == "sieve"
    handle.remove()
    assert "generate" not in model.__dict__ and model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="boom"), kvsieve.apply(model, kvsieve.EvictionConfig(rate=0.5)):
        raise ValueError("boom")
    assert "generate" not in model.__dict__ and model.config._attn_implementation == "sdpa"


def _run(script: str) -> str:
    """Run `script` in a fresh interpreter (tests/ on the path) and return its stdout."""
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r})\n" + textwrap.dedent(script)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_importing_kvsieve_changes_nothing_global():
    out = _run(
        """
        from transformers.utils import logging
        from transformers import AttentionInterface
        before = logging.get_verbosity()
        import kvsieve, kvsieve.harness.cli, kvsieve.harness.report, kvsieve.harness.eval, kvsieve.harness.compare
        print("pyplot" if "matplotlib.pyplot" in sys.modules else "no pyplot")
        print("same verbosity" if logging.get_verbosity() == before else "verbosity changed")
        print("registered" if "sieve" in AttentionInterface._global_mapping else "not registered")
        """
    )
    assert out.split("\n")[:3] == ["no pyplot", "same verbosity", "not registered"]


def test_loading_restores_transformers_logging(monkeypatch):
    from kvsieve.harness import models

    hf_logging.set_verbosity_info()
    try:
        with models._quiet_transformers():
            assert hf_logging.get_verbosity() == hf_logging.ERROR
        assert hf_logging.get_verbosity() == hf_logging.INFO
    finally:
        hf_logging.set_verbosity_warning()


KVPRESS_SIDE_BY_SIDE = """
    import torch, kvsieve
    from conftest import MaskedReference, tiny_llama
    from kvsieve.harness.compare import kvpress_compress

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(1))
    {before}
    import kvpress
    {after}
    with torch.no_grad():
        cache = kvsieve.compress(model, ids[:, :100], "snapkv+adaptive", 0.6, n_recent=8)
        kept = [cache.kept_positions(layer) for layer in range(3)]
        with kvsieve.sieve_attention(model):
            ours = model(ids[:, 100:], past_key_values=cache).logits
        with MaskedReference(model, ids[:, :100], kept) as ref:
            expected = model(ids[:, 100:], past_key_values=ref.cache).logits
        print(float((ours - expected).abs().max()))
        pressed = kvpress_compress(model, ids[:, :100], "adakv_expected_attention", 0.5)
        logits = pressed.forward(model, ids[:, 100:104])  # kvpress AdaKV feeds at most head_dim / 2 tokens
        print(bool(torch.isfinite(logits).all()), model.config._attn_implementation)
"""


@pytest.mark.parametrize(
    "before, after",
    [
        ("", ""),  # kvpress first, then kvsieve registers "sieve"
        ("with kvsieve.sieve_attention(model): pass", ""),  # "sieve" registered, then kvpress wraps it
        ("with kvsieve.sieve_attention(model): pass", "with kvsieve.sieve_attention(model): pass"),
    ],
)
def test_kvpress_imported_in_any_order_leaves_both_working(before, after):
    pytest.importorskip("kvpress")
    out = _run(KVPRESS_SIDE_BY_SIDE.format(before=before, after=after)).split()
    assert float(out[0]) < 1e-4, "kvsieve's compressed decoding equals the masked reference"
    assert out[1:] == ["True", "sdpa"], "kvpress's own pipeline runs and gives the model its attention back"


class _Counter:
    """Counts fused attention calls and the observed prefill's chunks (one in-place `exp_` each)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = {"sdpa": 0, "chunks": 0}
        sdpa, exp_ = F.scaled_dot_product_attention, torch.Tensor.exp_

        def counted_sdpa(*args: object, **kwargs: object) -> torch.Tensor:
            self.calls["sdpa"] += 1
            return sdpa(*args, **kwargs)

        def counted_exp_(tensor: torch.Tensor) -> torch.Tensor:
            self.calls["chunks"] += 1
            return exp_(tensor)

        monkeypatch.setattr(F, "scaled_dot_product_attention", counted_sdpa)
        monkeypatch.setattr(torch.Tensor, "exp_", counted_exp_)

    def take(self) -> dict[str, int]:
        calls, self.calls = self.calls, {"sdpa": 0, "chunks": 0}
        return calls


@torch.no_grad()
def _attention_calls(kv_heads: int, rows: int, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, int]]:
    """Attention calls of an observed prefill (both kinds), a decode step and a 7-token continuation."""
    model = tiny_llama(seed=1, layers=2, heads=8, kv_heads=kv_heads)
    ids = torch.randint(0, 128, (rows, 90), generator=torch.Generator().manual_seed(0))
    cache = kvsieve.compress(model, ids[:, :80], "snapkv+adaptive", 0.6)
    counter = _Counter(monkeypatch)
    kvsieve.observe_prefill(model, ids[:, :80], kvsieve.Needs(accumulated=True))
    accumulated = counter.take()
    kvsieve.observe_prefill(model, ids[:, :80], kvsieve.Needs(window=8))
    prefill = counter.take()
    with kvsieve.sieve_attention(model):
        model(ids[:, 80:81], past_key_values=cache)
        decode = counter.take()
        model(ids[:, 81:88], past_key_values=cache)
        continuation = counter.take()
    return [accumulated, prefill, decode, continuation]


def test_attention_calls_per_layer_do_not_grow_with_heads_or_batch(monkeypatch):
    few = _attention_calls(kv_heads=2, rows=1, monkeypatch=monkeypatch)
    assert few[0] == {"sdpa": 0, "chunks": 2}, "the accumulating prefill: one chunk of every head and row per layer"
    assert few[1:] == [{"sdpa": 2, "chunks": 0}] * 3, "one fused kernel call per layer"
    for kv_heads, rows in [(8, 1), (2, 3), (8, 3)]:
        assert _attention_calls(kv_heads, rows, monkeypatch) == few


@dataclass(eq=False)
class LinearKeyScorer(torch.nn.Module):
    """A learned scorer: a linear function of each key (a stand-in for retention gates)."""

    name: ClassVar[str] = "linear-key"
    calibrated: ClassVar[bool] = False
    needs: ClassVar[kvsieve.Needs] = kvsieve.Needs()
    head_dim: int = 16

    def __post_init__(self) -> None:
        super().__init__()
        self.projection = torch.nn.Linear(self.head_dim, 1)

    def score(self, obs: kvsieve.Observation) -> torch.Tensor:
        return self.projection(obs.keys.float())[..., 0]


@torch.no_grad()
def test_a_scorer_may_be_a_module_with_parameters(model, ids, masked_reference):
    torch.manual_seed(0)
    scorer = LinearKeyScorer()
    policy = Policy(scorer=scorer, n_recent=8)
    assert policy.name == "linear-key:n_recent=8" and sum(p.numel() for p in scorer.parameters()) == 17
    cache = kvsieve.compress(model, ids[:, :100], policy, 0.7)
    kept = [cache.kept_positions(layer) for layer in range(3)]
    keys = kvsieve.observe_prefill(model, ids[:, :100], kvsieve.Needs()).observations[0][0].keys
    best = scorer.projection(keys)[..., 0][:, 1:92].topk(91 - 64, dim=-1).indices + 1  # 64 of 91 evictable go
    for h in range(2):
        assert set(kept[0][h].tolist()) == {0, *best[h].tolist(), *range(92, 100)}
    with kvsieve.sieve_attention(model):
        ours = model(ids[:, 100:], past_key_values=cache).logits
    with masked_reference(model, ids[:, :100], kept) as ref:
        torch.testing.assert_close(ours, model(ids[:, 100:], past_key_values=ref.cache).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("spec", ["knorm", "keydiff+adaptive", "streaming+global", "random+pyramid"])
@torch.no_grad()
def test_an_evicted_cache_can_be_scored_and_evicted_again(model, ids, masked_reference, spec):
    """Observations of a ragged cache drive a second eviction, which stays exact."""
    cache = kvsieve.compress(model, ids[:, :100], "snapkv+adaptive", 0.4, n_recent=8)
    observations = kvsieve.observe_cache(model, cache)
    assert observations[0].valid is not None and not bool(observations[0].valid.all())
    keep = kvsieve.make_policy(spec, n_recent=8).select(observations, 0.5)
    before = [cache.kept_positions(layer) for layer in range(3)]
    cache.evict([keep])
    kept = [cache.kept_positions(layer) for layer in range(3)]
    for layer in range(3):
        for h, (old, new) in enumerate(zip(before[layer], kept[layer], strict=True)):
            assert set(new.tolist()) <= set(old.tolist()) and set(old[-8:].tolist()) <= set(new.tolist()), (layer, h)
    assert sum(map(sum, cache.stored_lengths())) < sum(map(len, (p for heads in before for p in heads)))
    with kvsieve.sieve_attention(model):
        ours = model(ids[:, 100:], past_key_values=cache).logits
    with masked_reference(model, ids[:, :100], kept) as ref:
        torch.testing.assert_close(ours, model(ids[:, 100:], past_key_values=ref.cache).logits, atol=1e-4, rtol=0)
