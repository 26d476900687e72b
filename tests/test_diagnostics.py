"""Routing diagnostics (GER, recall, consensus), sweep analysis and their figures, against brute-force references."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pandas as pd
import pytest
import torch

import kvsieve
from conftest import tiny_llama
from kvsieve.harness.eval.analysis import (
    accuracy_by_rate,
    against_full,
    cliff,
    consensus_by_depth,
    hallucination_vs_ger,
    layer_means,
    library_side_by_side,
    pearson,
    recall_by_depth,
)
from kvsieve.harness.eval.routing import (
    CONSENSUS_SCOPE,
    diagnose,
    evidence_recall,
    global_evicted,
    global_eviction_ratio,
    head_attention,
    head_consensus,
    survival_from_cache,
)
from kvsieve.harness.report.figures import (
    plot_accuracy_vs_rate,
    plot_consensus_by_depth,
    plot_eviction_map,
    plot_hallucination_vs_ger,
    plot_recall_by_depth,
)
from kvsieve.runtime.observing.prefill import observe_prefill
from kvsieve.selection.spec import make_policy

PNG = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- brute-force references


def brute_ger(survival: torch.Tensor, evidence: list[int], scope: str) -> float:
    layers, heads, _ = survival.shape
    evidence = sorted(set(evidence))
    if scope == "model":
        hits = [all(not survival[layer, h, t] for layer in range(layers) for h in range(heads)) for t in evidence]
    else:
        hits = [all(not survival[layer, h, t] for h in range(heads)) for layer in range(layers) for t in evidence]
    return sum(hits) / len(hits)


def brute_consensus(attention: torch.Tensor, kept: torch.Tensor | None, group: int) -> tuple[float, float]:
    winners = []
    for h in range(attention.shape[0]):
        candidates = [t for t in range(attention.shape[1]) if kept is None or bool(kept[h // group, t])]
        if not candidates:
            continue
        best = candidates[0]
        for t in candidates[1:]:
            if attention[h, t] > attention[h, best]:
                best = t
        winners.append(best)
    if not winners:
        return math.nan, math.nan
    return len(set(winners)) / len(winners), Counter(winners).most_common(1)[0][1] / len(winners)


def random_survival(layers: int = 3, heads: int = 2, n: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.rand(layers, heads, n, generator=torch.Generator().manual_seed(seed)) < 0.4


# ---------------------------------------------------------------- survival, GER, recall


def test_global_evicted_and_ger_match_loops():
    survival = random_survival()
    evidence = [0, 3, 3, 7, 11]
    per_layer = global_evicted(survival, "layer")
    model_wide = global_evicted(survival, "model")
    for t in range(survival.shape[-1]):
        assert bool(model_wide[t]) == (not survival[:, :, t].any())
        for layer in range(survival.shape[0]):
            assert bool(per_layer[layer, t]) == (not survival[layer, :, t].any())
    for scope in ("layer", "model"):
        assert global_eviction_ratio(survival, evidence, scope) == pytest.approx(brute_ger(survival, evidence, scope))
    recall = evidence_recall(survival, torch.tensor(evidence))
    for layer in range(survival.shape[0]):
        for head in range(survival.shape[1]):
            expected = sum(bool(survival[layer, head, t]) for t in {0, 3, 7, 11}) / 4
            assert recall[layer, head].item() == pytest.approx(expected)


def test_designed_ger_cases():
    survival = torch.zeros(2, 2, 6, dtype=torch.bool)
    survival[0, 0, 1] = True  # token 1 kept by one head of layer 0 only
    survival[:, 1, 2] = True  # token 2 kept in every layer
    assert global_eviction_ratio(survival, [1, 2], "model") == 0.0
    assert global_eviction_ratio(survival, [1, 2], "layer") == pytest.approx(1 / 4)  # (1, layer 1) is evicted
    assert global_eviction_ratio(survival, [3, 4], "layer") == 1.0


def test_empty_evidence_is_nan_and_bad_input_is_named():
    survival = random_survival()
    assert math.isnan(global_eviction_ratio(survival, [], "layer"))
    assert torch.isnan(evidence_recall(survival, torch.tensor([], dtype=torch.long))).all()
    with pytest.raises(ValueError, match="outside the context of 12 tokens"):
        global_eviction_ratio(survival, [3, 12])
    with pytest.raises(ValueError, match="valid scopes: layer, model"):
        global_evicted(survival, "head")
    with pytest.raises(ValueError, match=r"\[layers, kv_heads, n_context\], got \(2, 12\)"):
        global_evicted(survival[0], "layer")


def test_survival_from_a_real_compressed_cache():
    model = tiny_llama(seed=2, layers=2)
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(3))
    question = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(4))
    cache = kvsieve.compress(model, ids, "snapkv+adaptive", rate=0.6, question_ids=question)
    n_context = ids.shape[1]
    survival = survival_from_cache(cache, n_context)
    assert survival.shape == (2, 2, n_context)
    for layer in range(2):
        for head, positions in enumerate(cache.kept_positions(layer)):
            expected = {int(p) for p in positions if p < n_context}
            assert {int(t) for t in torch.nonzero(survival[layer, head]).flatten()} == expected
            assert any(int(p) >= n_context for p in positions)  # the question is stored but not counted
    assert not survival.all()  # something was evicted
    assert survival_from_cache(cache, 10).equal(survival[..., :10])


# ---------------------------------------------------------------- attention and consensus


@pytest.fixture(scope="module")
def prefilled():
    """A tiny model's full prefill, an eager-attention reference of the same model, and a compressed survival."""
    ids = torch.randint(0, 128, (1, 72), generator=torch.Generator().manual_seed(5))
    model = tiny_llama(seed=8, layers=3, heads=8, kv_heads=2)
    prefill = observe_prefill(model, ids)
    eager = tiny_llama(seed=8, layers=3, heads=8, kv_heads=2)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = eager(ids, output_attentions=True).attentions
    # little protection and a high rate, so that heads share argmax tokens and compression moves some of them
    observations = prefill.observations[0]
    keep = make_policy("snapkv+adaptive", n_recent=8).select(observations, 0.8)
    survival = survival_from_cache(prefill.cache.keep([keep]), ids.shape[1])
    return observations, attentions, survival


def test_head_attention_matches_eager_last_row(prefilled):
    observations, attentions, _ = prefilled
    for obs, reference in zip(observations, attentions, strict=True):
        got = head_attention(obs)
        assert got.shape == (8, 72)
        torch.testing.assert_close(got, reference[0, :, -1, :].float(), atol=1e-5, rtol=1e-4)


def test_head_consensus_matches_loops():
    generator = torch.Generator().manual_seed(11)
    attention = torch.rand(8, 20, generator=generator)
    attention[:, 4] = attention[:, 4] + torch.tensor([0, 0, 0, 0, 0, 0, 2.0, 2.0])  # two heads agree on token 4
    kept = torch.rand(2, 20, generator=generator) < 0.5
    assert head_consensus(attention, None, 4) == pytest.approx(brute_consensus(attention, None, 4))
    assert head_consensus(attention, kept, 4) == pytest.approx(brute_consensus(attention, kept, 4))
    rigid = torch.zeros(6, 9)
    rigid[:, 5] = 1.0
    assert head_consensus(rigid, None, 3) == pytest.approx((1 / 6, 1.0))
    nothing = torch.zeros(2, 9, dtype=torch.bool)
    nothing[1, 0] = True  # kv-head 0 kept nothing: its 3 query heads drop out, the others all pick token 0
    assert head_consensus(rigid, nothing, 3) == pytest.approx((1 / 3, 1.0))
    with pytest.raises(ValueError, match=r"survival row of shape \(3, 9\)"):
        head_consensus(rigid, torch.ones(3, 9, dtype=torch.bool), 3)


def test_diagnose_matches_brute_force(prefilled):
    observations, attentions, survival = prefilled
    evidence = [10, 11, 12, 40, 41]
    result = diagnose(observations, survival, torch.tensor(evidence))
    assert result.ger_layer == pytest.approx(brute_ger(survival, evidence, "layer"))
    assert result.ger_model == pytest.approx(brute_ger(survival, evidence, "model"))
    assert result.evidence_tokens == 5
    assert 0 < result.ger_model < result.ger_layer < 1  # the case is not degenerate
    assert min(result.consensus) < 1 and result.consensus != result.consensus_full
    for layer, reference in enumerate(attentions):
        last = reference[0, :, -1, :].float()
        full = brute_consensus(last, None, 4)
        after = brute_consensus(last, survival[layer], 4)
        assert result.consensus_full[layer] == pytest.approx(full[0])
        assert (result.consensus[layer], result.agreement[layer]) == pytest.approx(after)
        for head in range(2):
            kept = sum(bool(survival[layer, head, t]) for t in evidence) / len(evidence)
            assert result.recall[layer][head] == pytest.approx(kept)
    summary = json.loads(json.dumps(result.summary()))
    assert summary["consensus_scope"] == CONSENSUS_SCOPE
    assert summary["consensus_by_layer"] == pytest.approx(list(result.consensus))
    assert summary["consensus_mean"] == pytest.approx(float(np.mean(result.consensus)))
    assert summary["recall_mean"] == pytest.approx(float(np.mean(result.recall)))
    with pytest.raises(ValueError, match=r"survival of shape \(2, 2, 72\) has 2 layers, got 3 observations"):
        diagnose(observations, survival[:2], evidence)
    with pytest.raises(ValueError, match=r"survival of shape \(3, 1, 72\) does not fit layer 0"):
        diagnose(observations, survival[:, :1], evidence)
    empty = diagnose(observations, survival, [])
    assert math.isnan(empty.ger_layer) and math.isnan(empty.recall_mean) and empty.evidence_tokens == 0


# ---------------------------------------------------------------- sweep analysis

CURVES = {  # (library, policy, rate) -> correct per sample 0..3
    ("kvsieve", "full", 0.0): [1, 1, 1, 1],
    ("kvsieve", "snapkv", 0.25): [1, 1, 1, 1],
    ("kvsieve", "snapkv", 0.5): [1, 1, 1, 0],
    ("kvsieve", "snapkv", 0.75): [1, 0, 0, 0],
    ("kvsieve", "random", 0.25): [1, 1, 0, 0],
    ("kvsieve", "random", 0.5): [1, 1, 1, 1],
    ("kvpress", "kvpress:snapkv", 0.5): [1, 1, 0, 0],
}


def sweep_frame() -> pd.DataFrame:
    rows = []
    generator = np.random.default_rng(0)
    for (library, policy, rate), correct in CURVES.items():
        for index, ok in enumerate(correct):
            ger = 0.0 if policy == "full" else float(generator.uniform(0, 1))
            rows.append(
                {
                    "suite": "ruler",
                    "task": "niah",
                    "index": index,
                    "mode": "agnostic",
                    "library": library,
                    "policy": policy,
                    "rate": rate,
                    "score": 100.0 * ok,
                    "correct": bool(ok),
                    "abstained": (not ok) and index % 2 == 0,
                    "hallucinated": (not ok) and index % 2 == 1,
                    "gold_logprob": -float(index) - rate,
                    "gold_rank": index + int(10 * rate),
                    "kv_bytes": int(1000 * (1 - rate)) + (7 if library == "kvpress" else 0),
                    "seconds": 0.1 * (index + 1),
                    "ger_layer": ger,
                    "ger_model": ger / 2,
                    "recall_mean": 1 - ger,
                    "consensus_mean": 0.5,
                    "agreement_mean": 0.5,
                    "consensus_by_layer": [0.25 * index, 1 - rate, math.nan if index == 0 else rate],
                    "recall_by_layer": [1 - ger, 0.5 * index, 1.0],
                }
            )
    return pd.DataFrame(rows)


def test_accuracy_by_rate_puts_full_at_rate_zero():
    df = sweep_frame()
    table = accuracy_by_rate(df).set_index(["library", "policy", "rate"])
    for (library, policy, rate), correct in CURVES.items():
        row = table.loc[(library, policy, rate)]
        rows = df[(df["library"] == library) & (df["policy"] == policy) & (df["rate"] == rate)]
        assert row["accuracy"] == pytest.approx(sum(correct) / len(correct))
        assert row["n"] == len(correct)
        assert row["mean_score"] == pytest.approx(100 * sum(correct) / len(correct))
        assert row["hallucination_rate"] == pytest.approx(rows["hallucinated"].sum() / len(rows))
        assert row["abstention_rate"] == pytest.approx(rows["abstained"].sum() / len(rows))
        assert row["median_gold_rank"] == pytest.approx(float(np.median(rows["gold_rank"])))
        assert row["mean_kv_bytes"] == pytest.approx(float(np.mean(rows["kv_bytes"])))
        assert row["mean_ger"] == pytest.approx(float(np.mean(rows["ger_layer"])))
    for library, policy in [("kvsieve", "snapkv"), ("kvsieve", "random"), ("kvpress", "kvpress:snapkv")]:
        zero = table.loc[(library, policy, 0.0)]
        assert zero["accuracy"] == 1.0 and zero["n"] == 4 and zero["mean_ger"] == 0.0
    plain = accuracy_by_rate(df.drop(columns="ger_layer"))  # a sweep run without diagnostics
    assert "mean_ger" not in plain and plain["accuracy"].tolist() == table["accuracy"].tolist()


def test_pearson_against_numpy():
    generator = np.random.default_rng(1)
    x, y = generator.normal(size=30), generator.normal(size=30)
    y = y + 0.5 * x
    assert pearson(x, y) == pytest.approx(float(np.corrcoef(x, y)[0, 1]))
    x_nan = np.append(x, np.nan)
    assert pearson(x_nan, np.append(y, 3.0)) == pytest.approx(float(np.corrcoef(x, y)[0, 1]))
    assert math.isnan(pearson([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))
    assert math.isnan(pearson([1.0], [2.0]))


def test_hallucination_vs_ger():
    df = sweep_frame()
    result = hallucination_vs_ger(df)
    means, rates = [], []
    for _library, policy, rate in CURVES:
        rows = df[(df["policy"] == policy) & (df["rate"] == rate)]
        means.append(rows["ger_layer"].mean())
        rates.append(rows["hallucinated"].mean())
    assert result["n_points"] == len(CURVES)
    assert result["r_points"] == pytest.approx(float(np.corrcoef(means, rates)[0, 1]))
    expected = np.corrcoef(df["ger_layer"], df["hallucinated"].astype(float))[0, 1]
    assert result["r_samples"] == pytest.approx(float(expected))
    assert result["n_samples"] == len(df)
    assert "r_samples" in result["which"] and "r_points" in result["which"]


def test_consensus_by_depth():
    df = sweep_frame()
    table = consensus_by_depth(df).set_index(["policy", "rate", "layer"])
    for (_, policy, rate), correct in CURVES.items():
        layers = [[0.25 * i, 1 - rate, math.nan if i == 0 else rate] for i in range(len(correct))]
        for layer in range(3):
            values = [v[layer] for v in layers if not math.isnan(v[layer])]
            assert table.loc[(policy, rate, layer), "consensus"] == pytest.approx(sum(values) / len(values))


def test_recall_by_depth_means_each_layer_over_samples():
    df = sweep_frame()
    table = recall_by_depth(df).set_index(["policy", "rate", "layer"])
    for (_, policy, rate), correct in CURVES.items():
        rows = df[(df["policy"] == policy) & (df["rate"] == rate)]
        expected = np.mean(np.asarray(rows["recall_by_layer"].tolist()), axis=0)
        for layer in range(3):
            assert table.loc[(policy, rate, layer), "recall"] == pytest.approx(expected[layer])
            assert table.loc[(policy, rate, layer), "n"] == len(correct)


def test_layer_means_refuses_ragged_lists_and_missing_columns():
    df = sweep_frame()
    df.at[0, "recall_by_layer"] = [0.5]
    with pytest.raises(ValueError, match="recall_by_layer has different lengths \\[1, 3\\]"):
        recall_by_depth(df)
    with pytest.raises(ValueError, match="needs the sweep columns \\['depth_list'\\]"):
        layer_means(df, "depth_list", "depth")


def test_cliff_on_a_designed_curve():
    table = cliff(sweep_frame(), keep=0.9).set_index(["library", "policy"])
    snap = table.loc[("kvsieve", "snapkv")]
    assert snap["full_accuracy"] == 1.0 and snap["n_samples"] == 4
    assert snap["safe_rate"] == 0.25  # 0.75 accuracy at rate 0.5 is below 0.9 x 1.0
    # slopes: 0->0.25: 0, 0.25->0.5: 0.25/0.25 = 1, 0.5->0.75: 0.5/0.25 = 2
    assert (snap["cliff_from"], snap["cliff_to"]) == (0.5, 0.75)
    assert snap["cliff_drop_per_rate"] == pytest.approx(2.0)
    noisy = table.loc[("kvsieve", "random")]
    assert noisy["safe_rate"] is None  # the lowest rate already fails; a later recovery does not count
    assert (noisy["cliff_from"], noisy["cliff_to"]) == (0.0, 0.25)
    assert noisy["cliff_drop_per_rate"] == pytest.approx(0.5 / 0.25)
    press = table.loc[("kvpress", "kvpress:snapkv")]
    assert press["full_accuracy"] == 1.0 and press["safe_rate"] is None
    assert press["cliff_drop_per_rate"] == pytest.approx(0.5 / 0.5)


def test_against_full_pairs_the_samples_and_gives_verdicts():
    df = sweep_frame()  # gold log-prob is -index - rate: every policy row is exactly `rate` below its full row
    table = against_full(df).set_index(["library", "policy", "rate"])
    snap = table.loc[("kvsieve", "snapkv", 0.5)]
    assert snap["n"] == 4 and snap["accuracy"] == 0.75 and snap["full_accuracy"] == 1.0
    assert snap["delta_logprob"] == pytest.approx(-0.5) and snap["hi"] == pytest.approx(-0.5)
    assert set(table["verdict"]) == {"falls short"}
    lifted = df.assign(gold_logprob=np.where(df["policy"] == "full", df["gold_logprob"], df["gold_logprob"] + 0.6))
    lifted_table = against_full(lifted).set_index(["library", "policy", "rate"])
    assert lifted_table.loc[("kvsieve", "snapkv", 0.25), "verdict"] == "beats"  # +0.35 on every sample
    assert lifted_table.loc[("kvsieve", "snapkv", 0.75), "verdict"] == "falls short"  # -0.15, and lower accuracy
    # a log-prob interval above 0 decides even at lower accuracy (+0.1 on every sample, half the accuracy)
    assert lifted_table.loc[("kvpress", "kvpress:snapkv", 0.5), "verdict"] == "beats"
    same = against_full(df.assign(gold_logprob=-df["index"].astype(float))).set_index(["library", "policy", "rate"])
    assert same.loc[("kvsieve", "random", 0.5), "verdict"] == "level"  # equal log-prob, equal accuracy
    assert same.loc[("kvsieve", "snapkv", 0.75), "verdict"] == "falls short"  # equal log-prob, lower accuracy


def test_library_side_by_side():
    df = sweep_frame()
    table = library_side_by_side(df).set_index(["rate", "library", "policy"])
    press = table.loc[(0.5, "kvpress", "kvpress:snapkv")]
    assert press["accuracy"] == 0.5 and press["mean_kv_bytes"] == pytest.approx(507)
    assert press["mean_seconds"] == pytest.approx(np.mean([0.1, 0.2, 0.3, 0.4]))
    assert table.loc[(0.5, "kvsieve", "snapkv"), "mean_kv_bytes"] == pytest.approx(500)
    with pytest.raises(ValueError, match="needs the sweep columns \\['kv_bytes'\\]"):
        library_side_by_side(df.drop(columns=["kv_bytes"]))


# ---------------------------------------------------------------- figures


def test_figures_write_pngs(tmp_path):
    df = sweep_frame()
    survival = random_survival(layers=4, heads=3, n=50)
    both = pd.concat([df, df.assign(mode="aware")], ignore_index=True)
    ger = hallucination_vs_ger(both)
    paths = [
        plot_eviction_map(survival, [5, 6, 30], tmp_path / "map.png"),
        plot_eviction_map(survival, [5, 6, 30], tmp_path / "map_heads.png", per_head=True),
        plot_accuracy_vs_rate(accuracy_by_rate(both), tmp_path / "accuracy.png"),
        plot_hallucination_vs_ger(ger["points"], ger["r_points"], tmp_path / "ger.png"),
        plot_consensus_by_depth(consensus_by_depth(df), tmp_path / "consensus.png", title="tiny"),
        plot_recall_by_depth(recall_by_depth(df), tmp_path / "recall.png"),
    ]
    for path in paths:
        data = path.read_bytes()
        assert data[:8] == PNG and len(data) > 5000
