"""Perplexity protocol on a tiny model: against a plain transformers forward, and prefill-once == re-prefill."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kvsieve
from kvsieve.harness.eval import bootstrap_delta_ci, pooled_delta_pct, run_ppl
from kvsieve.harness.eval.respond import continuation_nll
from kvsieve.harness.runners import LocalRunner
from tokenizer import tiny_tokenizer

PREFIX, CONT = 64, 24


@pytest.fixture
def documents():
    gen = torch.Generator().manual_seed(5)
    return [(f"doc{i}", torch.randint(0, 128, (1, PREFIX + CONT + 1), generator=gen)) for i in range(3)]


@torch.no_grad()
def test_full_cache_nll_equals_plain_forward(model, documents):
    model.set_attn_implementation("sdpa")
    expected = []
    for _, ids in documents:
        logits = model(ids).logits[0]
        expected.append(float(F.cross_entropy(logits[PREFIX:-1], ids[0, PREFIX + 1 :], reduction="sum")))
    result = run_ppl(LocalRunner(model), documents, ["importance"], [0.0], PREFIX, CONT)
    np.testing.assert_allclose(result.nll_full, expected, rtol=1e-5)
    # rate 0 evicts nothing: same numbers as the full cache
    np.testing.assert_allclose(result.nll["importance", 0.0], expected, rtol=1e-5)


@torch.no_grad()
def test_prefill_once_equals_reprefill(model, documents):
    policies, rates = ["importance", "random", "knorm"], [0.5, 0.9]
    once = run_ppl(LocalRunner(model), documents, policies, rates, PREFIX, CONT)
    again = run_ppl(LocalRunner(model), documents, policies, rates, PREFIX, CONT, reprefill=True)
    assert once.nll.keys() == again.nll.keys()
    for key in once.nll:
        np.testing.assert_allclose(once.nll[key], again.nll[key], rtol=1e-6)
    assert once.nll["importance", 0.9] != once.nll["random", 0.9]


@torch.no_grad()
def test_batched_rows_equal_one_row_at_a_time(model, documents):
    """Feeding a document's configurations as rows of one batch gives the nll of feeding them one by one."""
    policies, rates = ["importance", "random", "knorm"], [0.5, 0.9]  # 7 configurations: batches of 4 and 3
    single = run_ppl(LocalRunner(model), documents, policies, rates, PREFIX, CONT, rows_per_pass=1)
    batched = run_ppl(LocalRunner(model), documents, policies, rates, PREFIX, CONT, rows_per_pass=4)
    np.testing.assert_allclose(batched.nll_full, single.nll_full, rtol=1e-4)
    assert batched.nll.keys() == single.nll.keys() == {(p, r) for p in policies for r in rates}
    for key in single.nll:
        assert len(batched.nll[key]) == len(single.nll[key]) == len(documents)
        np.testing.assert_allclose(batched.nll[key], single.nll[key], rtol=1e-4)
        assert batched.kv_bytes[key] == single.kv_bytes[key]
    # the configurations differ from each other, so a batch answering every row alike would not pass
    assert len({round(v[0], 3) for v in single.nll.values()}) == len(single.nll)


@torch.no_grad()
def test_report_rows(model, documents):
    result = run_ppl(LocalRunner(model), documents, ["importance", "random"], [0.5, 0.9], PREFIX, CONT)
    report = result.to_json()
    assert report["docs"] == 3 and report["tokens"] == 3 * CONT
    assert {"full_ppl", "docs", "tokens", "rows"} <= report.keys()
    rows = {(r["policy"], r["rate"]): r for r in report["rows"]}
    assert set(rows) == {(p, r) for p in ("importance", "random") for r in (0.5, 0.9)}
    for row in rows.values():
        assert set(row) == {"policy", "rate", "ppl", "delta_pct", "ci95", "kv_bytes"}
        assert row["ci95"][0] <= row["delta_pct"] <= row["ci95"][1]
        assert row["ppl"] == pytest.approx(report["full_ppl"] * (1 + row["delta_pct"] / 100))
    assert rows["importance", 0.9]["kv_bytes"] < rows["importance", 0.5]["kv_bytes"] < report["full_kv_bytes"]


def test_random_policy_draws_per_document(model, documents):
    result = run_ppl(LocalRunner(model), documents[:2], ["random"], [0.5], PREFIX, CONT)
    assert result.nll["random", 0.5][0] != result.nll["random", 0.5][1]


def test_document_too_short(model, documents):
    with pytest.raises(ValueError, match="needs 89"):
        run_ppl(LocalRunner(model), [("short", documents[0][1][:, :50])], ["importance"], [0.5], PREFIX, CONT)


def test_pooled_delta_and_bootstrap():
    nll_full = np.array([10.0, 20.0])
    tokens = np.array([5.0, 5.0])
    nll = nll_full + np.array([1.0, 1.0])
    assert pooled_delta_pct(nll, nll_full, tokens) == pytest.approx(100 * (np.exp(2.0 / 10.0) - 1))
    lo, hi = bootstrap_delta_ci(nll, nll_full, tokens)
    assert lo == pytest.approx(hi) == pytest.approx(100 * (np.exp(0.2) - 1))
    lo, hi = bootstrap_delta_ci(nll_full + np.array([0.0, 4.0]), nll_full, tokens)
    assert lo == pytest.approx(0.0) and hi == pytest.approx(100 * (np.exp(0.8) - 1))


@torch.no_grad()
def test_sentence_projection_keeps_the_sentences_compress_keeps(model, documents):
    """The protocol gives `projection=sentence` the prefix's sentences, as `kvsieve.compress(spans=...)` takes them."""
    tokenizer = tiny_tokenizer()
    policy = "snapkv:projection=sentence"
    result = run_ppl(LocalRunner(model, tokenizer), documents, [policy], [0.5], PREFIX, CONT)
    expected = []
    for _, ids in documents:
        prefix = ids[:, :PREFIX]
        spans = kvsieve.sentence_spans(tokenizer, prefix[0])
        assert spans.max() > 0, "the test needs prefixes of more than one sentence"
        cache = kvsieve.compress(model, prefix, policy, rate=0.5, spans=spans)
        with kvsieve.sieve_attention(model):
            expected += continuation_nll(model, cache, ids[:, PREFIX : PREFIX + CONT + 1])
    np.testing.assert_allclose(result.nll[policy, 0.5], expected, rtol=1e-5)
