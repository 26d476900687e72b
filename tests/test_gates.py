"""Retention gates (TrimKV / DBTrimKV): the module, soft retention, losses, training, checkpoints, the trimkv scorer."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import kvsieve
from conftest import tiny_gemma3, tiny_llama
from kvsieve import PolicyError
from kvsieve.harness.training.data import TrainingData
from kvsieve.harness.training.losses import capacity_loss, expected_kept
from kvsieve.harness.training.retention import (
    RetentionTape,
    decayed_attention,
    masked_decayed_attention,
    soft_retention,
)
from kvsieve.harness.training.train import TrainConfig, train_gates, train_step
from kvsieve.modeling.gates import Horizons, RetentionGates, gate_shape
from kvsieve.modeling.rotary import find_rotary, rotate_half
from kvsieve.selection import checkpoint
from kvsieve.selection.checkpoint import (
    GateCheckpointError,
    TrainRecord,
    load_gates,
    model_fingerprint,
    read_gates,
    save_gates,
)

SEQ = 48


def _tape(model, gates, length=SEQ) -> RetentionTape:
    return RetentionTape(gates, *find_rotary(model)(torch.arange(length)))


def _gates(model, bias: float = 3.0, seed: int = 0) -> RetentionGates:
    torch.manual_seed(seed)
    return RetentionGates(gate_shape(model, width=8), bias_init=bias).to(next(model.parameters()).dtype)


def _checkpoint(folder, model, gates: RetentionGates):
    """`gates` saved as a checkpoint for `model`."""
    record = TrainRecord("tiny", model_fingerprint(model), 8, "global", 1.0, 3, SEQ, 0, {"x": [1]}, 1.5)
    save_gates(gates, record, folder)
    return record


def test_one_scoring_projection_is_shared_by_every_layer_and_head():
    model = tiny_llama()
    gates = _gates(model)
    linears = [m for m in gates.modules() if isinstance(m, torch.nn.Linear)]
    assert linears == [gates.scoring], "one final projection object, no per-layer copy"
    assert [k for k in gates.state_dict() if k.startswith("scoring")] == ["scoring.weight", "scoring.bias"]
    keys, values = torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    before = [gates.log_beta(layer, keys, values) for layer in range(3)]
    with torch.no_grad():
        gates.scoring.bias += 1.0
    after = [gates.log_beta(layer, keys, values) for layer in range(3)]
    assert all((a > b).all() for a, b in zip(after, before, strict=True)), "moving the shared bias moves every layer"
    assert all((lb <= 0).all() for lb in after)


def test_untouched_gates_leave_the_model_exact():
    """With every log beta = 0 the soft-retention student is the teacher (float64)."""
    model = tiny_llama().double()
    gates = _gates(model).double()
    with torch.no_grad():
        gates.scoring.weight.zero_()
        gates.scoring.bias.fill_(800.0)  # log sigmoid(800) == 0 in float64
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        teacher = model(ids).logits
        tape = _tape(model, gates)
        with soft_retention(model, tape):
            student = model(ids).logits
    assert all(bool((lb == 0).all()) for lb in tape.log_beta.values()) and sorted(tape.log_beta) == [0, 1, 2]
    torch.testing.assert_close(student, teacher, atol=1e-10, rtol=0)
    assert model.config._attn_implementation == "sdpa", "the model's own attention comes back"


def test_soft_retention_equals_attention_with_the_decay_bias():
    """Each gated layer's logits get `(t - i) * log beta_i`: checked against an explicit float64 softmax."""
    model = tiny_llama(layers=1).double()
    gates = _gates(model, bias=1.0).double()
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(5))
    tape = _tape(model, gates, 16)
    with torch.no_grad(), soft_retention(model, tape):
        out = model(ids, output_hidden_states=True)
    attn = model.model.layers[0].self_attn
    hidden = model.model.layers[0].input_layernorm(out.hidden_states[0])
    q = attn.q_proj(hidden).view(1, 16, 4, 16).transpose(1, 2)
    k = attn.k_proj(hidden).view(1, 16, 2, 16).transpose(1, 2)
    v = attn.v_proj(hidden).view(1, 16, 2, 16).transpose(1, 2)
    log_beta = gates.log_beta(0, k, v)  # pre-RoPE keys straight from the projection
    torch.testing.assert_close(tape.log_beta[0], log_beta, atol=1e-8, rtol=0)
    cos, sin = model.model.rotary_emb(hidden, torch.arange(16)[None])
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    t = torch.arange(16)
    bias = (t[:, None] - t[None, :]) * log_beta[..., None, :]
    logits = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * attn.scaling + bias.repeat_interleave(2, 1)
    probs = torch.softmax(logits.masked_fill(t[None, :] > t[:, None], float("-inf")), dim=-1)
    expected = attn.o_proj((probs @ v.repeat_interleave(2, 1)).transpose(1, 2).reshape(1, 16, 64))
    residual = out.hidden_states[0] + expected
    mlp = model.model.layers[0].mlp(model.model.layers[0].post_attention_layernorm(residual))
    torch.testing.assert_close(model.model.norm(residual + mlp), out.hidden_states[1], atol=1e-6, rtol=0)


def test_gradients_reach_only_the_gates():
    model = tiny_llama()
    gates = _gates(model)
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(3))
    terms = train_step(model, gates, _tape(model, gates), ids, TrainConfig(capacity=8, seq_len=SEQ))
    torch.autograd.backward(terms["loss"], inputs=list(gates.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gates.parameters())


def test_expected_kept_and_the_capacity_hinge():
    log_beta = torch.log(torch.tensor([[[0.5, 1.0, 0.25]]]))
    kept = expected_kept(log_beta)
    torch.testing.assert_close(kept, torch.tensor([[[1.0, 1.5, 1.25 + 1.0]]]))  # S_t = sum_i beta_i^(t-i)
    # hinge (S_t - M) / max(t - M, 1) at t = 0, 1, 2: 0, 0.5, 1.25; the mean of the positive terms
    torch.testing.assert_close(capacity_loss([log_beta], capacity=1, scope="head"), torch.tensor((0.5 + 1.25) / 2))
    assert float(capacity_loss([log_beta], capacity=3, scope="head")) == 0.0
    two = [log_beta, torch.zeros(1, 1, 3)]  # a second head keeps everything: S = 1, 2, 3
    # global: S summed over both heads (2, 3.5, 5.25) against M * 2 = 2, steps scaled by 2 (0, 2, 4)
    expected = ((3.5 - 2) / 1 + (5.25 - 2) / 2) / 2
    torch.testing.assert_close(capacity_loss(two, capacity=1, scope="global"), torch.tensor(expected))


def test_training_lowers_the_loss_and_resumes(tmp_path):
    model = tiny_llama()
    data = TrainingData(
        [torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(s)) for s in range(4)], {}
    )
    config = TrainConfig(capacity=8, steps=12, seq_len=SEQ, lr=5e-2, width=8, bias_init=4.0, save_every=6)
    gates, record = train_gates(model, None, config, tmp_path / "a", "tiny", data=data, show_progress=False)
    torch.manual_seed(config.seed)
    fresh = RetentionGates(gate_shape(model, 8), bias_init=4.0)
    with torch.no_grad():
        before = sum(float(train_step(model, fresh, _tape(model, fresh), d, config)["loss"]) for d in data.sequences)
        after = sum(float(train_step(model, gates, _tape(model, gates), d, config)["loss"]) for d in data.sequences)
    assert after < 0.8 * before
    assert record.steps == 12 and record.model_hash == model_fingerprint(model)
    # an interrupted run (state saved at step 6) finishes to the same gates as an uninterrupted one
    half = dataclasses.replace(config, steps=6)
    train_gates(model, None, half, tmp_path / "b", "tiny", data=data, show_progress=False)
    state = torch.load(tmp_path / "b" / "train_state.pt", weights_only=True)
    state["config"] = dataclasses.asdict(config)
    del state["config"]["answer_weight"]  # saved before that setting existed: read as its default
    torch.save(state, tmp_path / "b" / "train_state.pt")
    resumed, _ = train_gates(model, None, config, tmp_path / "b", "tiny", data=data, show_progress=False)
    for name, tensor in gates.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], tensor, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="saved by a run with other settings"):
        train_gates(model, None, dataclasses.replace(config, lr=1e-3), tmp_path / "b", "tiny", data=data)


def test_checkpoint_round_trip_and_wrong_models(tmp_path):
    model = tiny_llama()
    gates = _gates(model)
    record = _checkpoint(tmp_path, model, gates)
    loaded, got = read_gates(tmp_path)
    assert got == record
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in gates.state_dict().items())
    assert load_gates(tmp_path, model).shape == gates.shape
    with pytest.raises(GateCheckpointError, match="weights hash"):
        load_gates(tmp_path, tiny_llama(seed=1))  # same dimensions, other weights
    with pytest.raises(GateCheckpointError, match="kv-heads"):
        load_gates(tmp_path, tiny_llama(kv_heads=4))
    with pytest.raises(GateCheckpointError, match="not a retention-gate checkpoint"):
        load_gates(tmp_path / "nowhere", model)
    with pytest.raises(GateCheckpointError, match=r"before the parameters: 'trimkv\+global:gates="):
        kvsieve.compress(model, torch.randint(0, 128, (1, 40)), f"trimkv:gates={tmp_path}+global", rate=0.5)
    with pytest.raises(GateCheckpointError, match="ships no retention gates"):
        kvsieve.compress(model, torch.randint(0, 128, (1, 40)), "trimkv", rate=0.5)


def test_shipped_checkpoints_load_by_name_and_the_default_is_the_one_named_after_the_model(tmp_path, monkeypatch):
    model = tiny_llama()
    _checkpoint(tmp_path / "replaced-tiny", model, _gates(model, seed=1))  # sorts first: the hash alone finds it
    _checkpoint(tmp_path / "tiny", model, _gates(model, seed=2))
    monkeypatch.setattr(checkpoint, "SHIPPED", tmp_path)
    (tmp_path / "local").mkdir()
    monkeypatch.chdir(tmp_path / "local")
    for name in ("default", "tiny", "replaced-tiny"):
        want = read_gates(tmp_path / ("tiny" if name == "default" else name))[0].state_dict()
        got = load_gates(name, model).state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items()), name
    assert not torch.equal(load_gates("tiny", model).scoring.weight, load_gates("replaced-tiny", model).scoring.weight)
    ids = torch.randint(0, 128, (1, 40))
    names = ("tiny", "default", "replaced-tiny")
    lengths = [kvsieve.compress(model, ids, f"trimkv+global:gates={name}", rate=0.5).stored_lengths() for name in names]
    assert lengths[0] == lengths[1]
    with pytest.raises(GateCheckpointError, match="the shipped checkpoints, by name: replaced-tiny, tiny"):
        load_gates("tiny-2025", model)


@torch.no_grad()
def test_trimkv_scores_decay_as_distance_times_log_beta(tmp_path):
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(2))
    policy = kvsieve.make_policy("trimkv:gates=untrained")
    prefill = kvsieve.observe_prefill(model, ids, policy.needs)
    gates = load_gates("untrained", model)
    out = model(ids, output_hidden_states=True)
    for obs in prefill.observations[0]:
        attn = model.model.layers[obs.layer_idx].self_attn
        hidden = model.model.layers[obs.layer_idx].input_layernorm(out.hidden_states[obs.layer_idx])
        keys = attn.k_proj(hidden).view(60, 2, 16).transpose(0, 1)
        values = attn.v_proj(hidden).view(60, 2, 16).transpose(0, 1)
        log_beta = gates.log_beta(obs.layer_idx, keys, values)
        expected = (60 - torch.arange(60)) * log_beta
        torch.testing.assert_close(policy.scorer.score(obs), expected, atol=1e-5, rtol=1e-5)
        ahead = kvsieve.make_policy("trimkv:gates=untrained,horizon=100").scorer.score(obs)
        torch.testing.assert_close(ahead, (160 - torch.arange(60)) * log_beta, atol=1e-5, rtol=1e-5)
        forever = kvsieve.make_policy("trimkv:gates=untrained,horizon=inf").scorer.score(obs)
        torch.testing.assert_close(forever, log_beta, atol=1e-6, rtol=1e-6)


@torch.no_grad()
def test_a_horizon_ahead_keeps_slowly_decaying_entries_over_recent_ones(tmp_path):
    """At the next step a recent entry that decays fast can outrank an old one that barely decays; at ``inf``
    only `log beta` counts, pooled over layers and heads by the global allocator."""
    model = tiny_llama()
    gates = _gates(model)
    torch.nn.init.normal_(gates.scoring.weight, std=1.0)
    _checkpoint(tmp_path, model, gates)
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(3))
    caches = {
        horizon: kvsieve.compress(model, ids, f"trimkv+global:gates={tmp_path},horizon={horizon}", rate=0.75)
        for horizon in ("0", "inf")
    }

    def mean_evictable_position(cache) -> float:
        positions = torch.cat([p for layer in range(2) for p in cache.kept_positions(layer)])
        return float(positions[(positions >= 1) & (positions < 68)].float().mean())  # a sink, 32 recent kept

    mean_position = {h: mean_evictable_position(c) for h, c in caches.items()}
    assert mean_position["inf"] < mean_position["0"] - 2, "further ahead, older entries are kept"
    policy = kvsieve.make_policy(f"trimkv+global:gates={tmp_path},horizon=inf")
    assert policy.name == f"trimkv+global:gates={tmp_path},horizon=inf"
    _assert_pooled_top_k(model, ids, policy, caches["inf"], n_sink=1, n_recent=32)
    for bad in ("-1", "nan"):
        with pytest.raises(PolicyError, match="horizon must be a number of tokens >= 0 or inf"):
            kvsieve.make_policy(f"trimkv:horizon={bad}")


@torch.no_grad()
def test_a_checkpoint_records_the_horizon_trimkv_reads_it_at(tmp_path):
    """`horizon=default` reads the gates at the horizon their checkpoint records (config.json; `inf` as text, JSON
    has no infinity); a horizon in the spec overrides it; a checkpoint's bad horizon is a clear error."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(4))
    for recorded in (100.0, math.inf):
        gates = _gates(model)
        gates.horizons = Horizons(recorded)
        _checkpoint(tmp_path / str(recorded), model, gates)
    score = {}
    for folder, spec in [("100.0", ""), ("100.0", ",horizon=0"), ("inf", ""), ("inf", ",horizon=100")]:
        policy = kvsieve.make_policy(f"trimkv:gates={tmp_path / folder}{spec}")
        prefill = kvsieve.observe_prefill(model, ids, policy.needs)
        score[folder, spec] = torch.stack([policy.scorer.score(obs) for obs in prefill.observations[0]])
    log_beta = score["inf", ""]  # the same weights, recorded at inf: `log beta` alone
    distance = torch.arange(60, 0, -1)
    torch.testing.assert_close(score["100.0", ""], (distance + 100) * log_beta, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(score["100.0", ",horizon=0"], distance * log_beta, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(score["inf", ",horizon=100"], score["100.0", ""], atol=1e-5, rtol=1e-5)
    config = json.loads((tmp_path / "inf" / checkpoint.CONFIG_FILE).read_text())
    assert config["horizon"] == config["bounded_horizon"] == "inf"
    assert read_gates(tmp_path / "inf")[0].horizons == Horizons(math.inf, math.inf)
    assert kvsieve.make_policy("trimkv+global").name == "trimkv+global", "the default horizon is not spelled out"
    del config["bounded_horizon"]  # a checkpoint from before kvsieve recorded two: one horizon for both
    (tmp_path / "inf" / checkpoint.CONFIG_FILE).write_text(json.dumps(config))
    assert read_gates(tmp_path / "inf")[0].horizons == Horizons(math.inf, math.inf)
    for key, value, message in [("horizon", -5, "horizon"), ("bounded_horizon", "soon", "bounded horizon")]:
        (tmp_path / "inf" / checkpoint.CONFIG_FILE).write_text(json.dumps(config | {key: value}))
        with pytest.raises(GateCheckpointError, match=f"{message} must be a number of tokens >= 0 or inf, got"):
            read_gates(tmp_path / "inf")


@torch.no_grad()
def test_one_compression_and_a_bounded_cache_read_their_own_horizons(tmp_path):
    """A checkpoint records one horizon for compressing a prompt once and one for a cache held at a size as it
    grows: `compress` with a rate reads the first; a prompt compressed to a size held during generation (`buffer`)
    and a chunked prefill (evicted again and again) the second; each keeps what a spec naming that horizon keeps."""
    model = tiny_llama()
    gates = _gates(model)
    torch.nn.init.normal_(gates.scoring.weight, std=1.0)
    gates.horizons = Horizons(once=math.inf, bounded=0)
    _checkpoint(tmp_path, model, gates)
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(5))

    def kept(spec: str, **budget) -> list:
        cache = kvsieve.compress(model, ids, f"trimkv+global:gates={tmp_path}{spec}", n_recent=4, **budget)
        return [p.tolist() for layer in cache.full_layers for p in cache.kept_positions(layer)]

    once = {"rate": 0.75}
    assert kept("", **once) == kept(",horizon=inf", **once) != kept(",horizon=0", **once)
    for bounded in ({"max_tokens": 24, "buffer": 8}, {"max_tokens": 24, "chunk": 20}):
        assert kept("", **bounded) == kept(",horizon=0", **bounded) != kept(",horizon=inf", **bounded)
    policy = kvsieve.make_policy(f"trimkv:gates={tmp_path}")
    obs = kvsieve.observe_prefill(model, ids, policy.needs).observations[0][0]
    assert not obs.bounded, "an observed prefill is compressed once"
    score = policy.scorer.score(dataclasses.replace(obs, bounded=True))
    torch.testing.assert_close(score, (120 - torch.arange(120)) * policy.scorer.score(obs), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="bounded horizon must be a number of tokens >= 0 or inf, got -1"):
        Horizons(once=0, bounded=-1)


@torch.no_grad()
def test_trimkv_global_meets_one_budget_exactly_across_layers_and_heads(tmp_path):
    model = tiny_llama()
    gates = _gates(model)
    torch.nn.init.normal_(gates.scoring.weight, std=1.0)  # entries decay at clearly different rates
    _checkpoint(tmp_path, model, gates)
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(2))
    policy = kvsieve.make_policy(f"trimkv+global:gates={tmp_path}", n_sink=1, n_recent=4)
    assert policy.allocator.calibration == "auto"
    cache = kvsieve.compress(model, ids, policy, rate=0.75)
    evictable = 100 - 1 - 4
    kept = sum(n - 5 for layer in cache.stored_lengths() for n in layer)
    assert kept == 6 * (evictable - round(0.75 * evictable))
    assert len({n for layer in cache.stored_lengths() for n in layer}) > 1, "heads and layers keep different counts"
    # raw scores decide: the kept evictable entries are the best of the pooled scores
    _assert_pooled_top_k(model, ids, policy, cache, n_sink=1, n_recent=4)


def _assert_pooled_top_k(model, ids: torch.Tensor, policy, cache, n_sink: int, n_recent: int) -> None:
    """Every (layer, kv-head) of `cache` keeps exactly its evictable entries among the best of `policy`'s scores
    pooled over all of them (one global top-k)."""
    prefill = kvsieve.observe_prefill(model, ids, policy.needs)
    end = ids.shape[1] - n_recent
    scores = [policy.scorer.score(obs)[:, n_sink:end] for obs in prefill.observations[0]]
    protected = n_sink + n_recent
    stored = cache.stored_lengths()
    kept = sum(n - protected for layer in stored for n in layer)
    threshold = torch.cat([s.flatten() for s in scores]).topk(kept).values.min()
    for layer, layer_scores in enumerate(scores):
        for head, head_scores in enumerate(layer_scores):
            assert stored[layer][head] - protected == int((head_scores >= threshold).sum())


@torch.no_grad()
def test_trimkv_bounded_generation_on_a_hybrid_model():
    """Gates exist for the full-attention layers only; the budget holds at every eviction during decoding."""
    model = tiny_gemma3()
    assert gate_shape(model).layers == (1, 3)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    spec = "trimkv+global:gates=untrained"
    config = kvsieve.EvictionConfig(policy=spec, max_tokens=24, buffer=8, n_recent=4)
    with kvsieve.apply(model, config) as handle:
        model.generate(ids, max_new_tokens=60, do_sample=False, pad_token_id=0)
    full = handle.last_cache.full_layers
    assert sum(sum(handle.last_cache.stored_lengths()[i]) for i in full) <= 2 * 2 * (24 + 8)


def test_train_gates_command_writes_a_checkpoint_the_scorer_loads(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from kvsieve.harness.cli import app

    out = tmp_path / "gates"
    args = ["train-gates", "--model", str(model_dir), "--out", str(out), "--steps", "2", "--seq-len", "256"]
    trained_args = [*args, "--capacity", "16", "--per-task", "0", "--horizon", "inf", "--bounded-horizon", "128"]
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, trained_args)
    assert result.exit_code == 0, result.output
    gates, record = read_gates(out)
    assert gates.horizons == Horizons(math.inf, 128), "--horizon and --bounded-horizon are kept in the checkpoint"
    assert record.steps == 2 and record.capacity == 16 and record.model_name == str(model_dir)
    assert set(record.data["heldout_essays"]).isdisjoint(record.data["train_essays"])
    assert record.data["task_seed"] > 1000, "training tasks never share a seed with evaluation"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()  # loaded again: the same weights hash
    ids = torch.randint(0, 100, (1, 80), generator=torch.Generator().manual_seed(0))
    trained = kvsieve.make_policy(f"trimkv+global:gates={out}")
    untrained = kvsieve.make_policy("trimkv+global:gates=untrained")
    prefill = kvsieve.observe_prefill(model, ids, trained.needs | untrained.needs)  # two sets of gates, one prefill
    first = prefill.observations[0][0]
    assert not torch.equal(trained.scorer.score(first), untrained.scorer.score(first))
    bad = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--scope", "layer"])
    assert bad.exit_code == 2 and "scope must be one of" in bad.output
    short = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--capacity", "16", "--per-task", "1"])
    assert short.exit_code == 2 and "too small" in short.output, "task prompts that do not fit: a clean error"
    behind = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--horizon", "-3"])
    assert behind.exit_code == 2 and "horizon must be a number of tokens >= 0" in behind.output
    behind = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--bounded-horizon", "-3"])
    assert behind.exit_code == 2 and "bounded horizon must be a number of tokens >= 0" in behind.output


def test_decay_bias_in_the_fused_kernel_equals_the_explicit_bias():
    """The folded dot product gives the explicit `(t - i) log beta_i` bias, outputs and gradients (GQA, float32)."""
    gen = torch.Generator().manual_seed(11)
    query, key, value = (torch.randn(2, h, 300, 16, generator=gen).requires_grad_() for h in (4, 2, 2))
    log_beta = (-3 * torch.rand(2, 2, 300, generator=gen)).requires_grad_()
    outputs, grads = [], []
    for attend in (decayed_attention, masked_decayed_attention):
        out = attend(query, key, value, log_beta, 0.25)
        outputs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), (query, key, value, log_beta)))
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-4, rtol=1e-4)
    for fused, explicit in zip(*grads, strict=True):
        torch.testing.assert_close(fused, explicit, atol=1e-3, rtol=1e-3)


def test_a_bfloat16_teacher_rounds_the_targets_only_and_trains(tmp_path):
    model = tiny_llama()
    gates = _gates(model)
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(3))
    config = TrainConfig(capacity=8, steps=12, seq_len=SEQ, lr=5e-2, width=8, bias_init=4.0, save_every=12)
    rounded = dataclasses.replace(config, teacher_dtype="bfloat16")
    with torch.no_grad():
        exact, cast = (train_step(model, gates, _tape(model, gates), ids, c) for c in (config, rounded))
    assert float(cast["capacity"]) == float(exact["capacity"])  # the student and its gates are untouched
    assert float(cast["kl"]) != float(exact["kl"])  # the teacher did run in bfloat16 ...
    assert abs(float(cast["kl"]) - float(exact["kl"])) < 0.1 * float(exact["kl"])  # ... to its rounding
    data = TrainingData([ids], {})
    trained, _ = train_gates(model, None, rounded, tmp_path, "tiny", data=data, show_progress=False)
    with torch.no_grad():
        after = float(train_step(model, trained, _tape(model, trained), ids, config)["loss"])
    assert after < 0.8 * float(exact["loss"])
    with pytest.raises(ValueError, match="teacher_dtype must be one of"):
        TrainConfig(teacher_dtype="int8")
