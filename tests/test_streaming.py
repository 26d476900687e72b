"""Streaming perplexity: pooling, chunked == token-by-token, the bound, the full cache, kvpress's DecodingPress, CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import kvsieve
from extras import needs_kvpress
from kvsieve.harness.cli import app
from kvsieve.harness.compare.kvpress import PressStream
from kvsieve.harness.eval.contenders import parse_contenders
from kvsieve.harness.eval.streaming import (
    StreamResult,
    StreamRun,
    plan_streaming,
    run_streaming,
    stream_trace,
    streaming_documents,
)
from kvsieve.harness.eval.streams import CacheSize, feed_stream, sieved_size
from kvsieve.harness.report import plot_stream_ppl, stream_markdown
from kvsieve.harness.runners import LocalRunner
from tokenizer import tiny_tokenizer

runner = CliRunner(env={"COLUMNS": "250"})  # rich must not wrap an error message inside its box
ENTRY_BYTES = 2 * 16 * 4  # tiny_llama: key + value of head_dim 16 in float32
HEADS = 3 * 2  # tiny_llama: 3 layers x 2 kv-heads


def _ids(rows: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (rows, length), generator=torch.Generator().manual_seed(seed))


def _docs(rows: int, length: int) -> list[tuple[str, torch.Tensor]]:
    return [(f"doc{i}", ids[None]) for i, ids in enumerate(_ids(rows, length))]


def _trace(model: torch.nn.Module, ids: torch.Tensor, spec: str, budget: int, buffer: int):
    """The stream of the method a policy spec or ``kvpress:<press>`` names."""
    return stream_trace(model, ids, parse_contenders(spec)[-1], budget, buffer)


def test_pooled_and_bucketed_ppl_equal_a_direct_computation():
    nan = math.nan
    full = np.array([[nan, 1.0, 2.0, 3.0, 4.0, nan, nan, nan], [nan, 2.0, 2.0, 2.0, 2.0, nan, nan, nan]])
    bounded = np.array([[nan, 1.0, 2.0, 3.5, 4.5, 5.0, 6.0, 7.0], [nan, 2.0, 2.0, 2.5, 2.5, 3.0, 3.0, 3.0]])
    result = StreamResult(["a", "b"], doc_tokens=8, buffer=2, bucket=4, context_limit=4)
    timing = {"seconds": 0.032, "tokens": 16}
    result.runs = [
        StreamRun("full", "kvsieve", None, list(full), **timing),
        StreamRun("snapkv", "kvsieve", 3, list(bounded), **timing),
    ]
    report = result.to_json()
    full_row, row = report["rows"]
    assert full_row["ppl"] == pytest.approx(math.exp(18.0 / 8)) and full_row["tokens"] == 8
    # after the first 3 tokens: positions 3..7 of both documents
    assert row["ppl"] == pytest.approx(math.exp((26.0 + 14.0) / 10)) and row["tokens"] == 10
    assert row["doc_ppl"] == pytest.approx([math.exp(26.0 / 5), math.exp(14.0 / 5)])
    assert row["ci95"][0] <= row["ppl"] <= row["ci95"][1]
    # positions 0-3 (position 0 predicts nothing) and 4-7; the full cache scored only position 4 of the second
    assert [b["ppl"] for b in row["buckets"]] == pytest.approx([math.exp(13.0 / 6), math.exp(34.0 / 8)])
    assert full_row["buckets"][1]["ppl"] == pytest.approx(math.exp(3.0)) and full_row["vs_full"] is None
    versus = row["vs_full"]  # positions 3 and 4, where both scored
    assert versus["tokens"] == 4 and versus["positions"] == [3, 4]
    assert versus["delta_pct"] == pytest.approx(100 * (math.exp(2.0 / 4) - 1))
    assert versus["ppl"] == pytest.approx(math.exp(13.0 / 4))
    assert versus["full_ppl"] == pytest.approx(math.exp(11.0 / 4))
    assert row["ms_per_token"] == pytest.approx(2.0)
    table = stream_markdown(report)
    assert "| snapkv | 3 |" in table and "+64.9% [" in table and "0-4k" not in table


@pytest.mark.parametrize("policy", ["snapkv:n_recent=8", "h2o:n_recent=8", "streaming:n_recent=8"])
@torch.no_grad()
def test_chunks_of_the_buffer_equal_token_by_token(model, policy):
    """Forwards of `buffer` tokens evict where 1-token steps do: the same logits at every position."""
    ids, budget, buffer = _ids(2, 72), 24, 8
    logits: dict[int, list[torch.Tensor]] = {1: [], buffer: []}
    for step in logits:
        cache = kvsieve.bounded_cache(model, policy, max_tokens=budget, buffer=buffer)

        def forward(chunk: torch.Tensor, start: int, cache=cache, out=logits[step]) -> torch.Tensor:
            out.append(model(input_ids=chunk, past_key_values=cache, use_cache=True).logits)
            return out[-1]

        with kvsieve.sieve_attention(model):
            feed_stream(ids, forward, lambda cache=cache: sieved_size(cache), step)
        assert cache.mean_stored() < ids.shape[1]  # it evicted
    torch.testing.assert_close(torch.cat(logits[1], 1), torch.cat(logits[buffer], 1), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_the_cache_never_exceeds_budget_plus_buffer(model):
    ids, budget, buffer = _ids(2, 120), 40, 16
    cache = kvsieve.bounded_cache(model, "snapkv", max_tokens=budget, buffer=buffer)
    held: list[int] = []

    def forward(chunk: torch.Tensor, start: int) -> torch.Tensor:
        logits = model(input_ids=chunk, past_key_values=cache, use_cache=True).logits
        held.append(max(n for row in range(2) for layer in cache.stored_lengths(row) for n in layer))
        return logits

    with kvsieve.sieve_attention(model):
        trace = feed_stream(ids, forward, lambda: sieved_size(cache), buffer)
    assert max(held) == budget + buffer and held[-1] <= budget + buffer
    assert trace.peak == CacheSize(
        (budget + buffer) * ENTRY_BYTES * HEADS, trace.peak.allocated, float(budget + buffer)
    )
    assert trace.peak.nbytes <= trace.peak.allocated and trace.tokens == 2 * 120
    assert _trace(model, ids, "snapkv", budget, buffer).peak == trace.peak


@torch.no_grad()
def test_full_cache_streaming_equals_one_plain_forward_within_the_context(model):
    docs, limit = _docs(3, 64), 40
    model.config.max_position_embeddings = limit  # the full cache is fed up to here
    result = run_streaming(LocalRunner(model), docs, [], [16], buffer=8, bucket=16, rows_per_pass=2)
    nll = np.stack(result.full.nll)
    for row, (_, ids) in enumerate(docs):
        logits = model(ids[:, :limit]).logits[0]
        expected = F.cross_entropy(logits, ids[0, 1 : limit + 1], reduction="none")
        np.testing.assert_allclose(nll[row, 1 : limit + 1], expected.numpy(), rtol=1e-5)
    assert np.isnan(nll[:, 0]).all() and np.isnan(nll[:, limit + 1 :]).all()
    assert result.context_limit == limit and len(result.runs) == 1
    assert [b["ppl"] is None for b in result.buckets(result.full)] == [False, False, False, True]  # 48-63: unfed


@needs_kvpress
@torch.no_grad()
def test_kvpress_stream_compresses_and_its_first_chunk_is_the_plain_model(model):
    ids, budget, buffer = _ids(2, 96), 24, 8
    stream = PressStream(model, "knorm", budget, buffer)
    with stream.running():
        first = stream.forward(ids[:, :buffer], 0)
        held = [stream.mean_stored()]
        for start in range(buffer, ids.shape[1], buffer):
            stream.forward(ids[:, start : start + buffer], start)
            held.append(stream.mean_stored())
    torch.testing.assert_close(first, model(ids[:, :buffer]).logits)
    assert max(held) == budget == held[-1]  # compressed after every forward once past the target
    assert stream.nbytes() == 2 * budget * ENTRY_BYTES * HEADS == stream.allocated_nbytes()
    trace = _trace(model, ids, "kvpress:knorm", budget, buffer)
    assert trace.peak == CacheSize(budget * ENTRY_BYTES * HEADS, budget * ENTRY_BYTES * HEADS, float(budget))


@needs_kvpress
@pytest.mark.parametrize(("policy", "press"), [("knorm", "knorm"), ("tova", "tova")])
@torch.no_grad()
def test_kvpress_stream_equals_kvsieve_with_its_protection(model, policy, press):
    """kvpress protects nothing (knorm) or the last token (tova); kvsieve set alike keeps the same entries."""
    ids = _ids(2, 128)
    protection = "n_sink=0,n_recent=0" if press == "knorm" else "n_sink=0,n_recent=1"
    ours = _trace(model, ids, f"{policy}:{protection}", 32, 16)
    theirs = _trace(model, ids, f"kvpress:{press}", 32, 16)
    np.testing.assert_allclose(ours.nll, theirs.nll, atol=1e-3, rtol=0)  # NaN at position 0 in both
    unprotected = _trace(model, ids, policy, 40, 16)
    assert np.nanmax(np.abs(unprotected.nll - theirs.nll)) > 1e-3  # the default protection differs


@needs_kvpress
def test_plan_errors(model):
    docs = _docs(2, 64)
    with pytest.raises(ValueError, match="one length"):
        plan_streaming(LocalRunner(model), [docs[0], ("short", docs[1][1][:, :50])], [], [16])
    with pytest.raises(ValueError, match="leaves nothing to score"):
        plan_streaming(LocalRunner(model), docs, [], [64])
    with pytest.raises(kvsieve.PolicyError, match="max_tokens=16 is smaller than the 33 protected entries"):
        plan_streaming(LocalRunner(model), docs, ["random", "streaming"], [16, 48], buffer=8)
    with pytest.raises(ValueError, match="not run on streams"):
        plan_streaming(LocalRunner(model), docs, ["kvpress:observed_attention"], [40], buffer=8)
    with pytest.raises(ValueError, match="use chunks longer"):
        plan_streaming(LocalRunner(model), docs, ["kvpress:snapkv"], [40], buffer=32)


def test_documents_have_the_asked_length(tmp_path):
    tokenizer = tiny_tokenizer()
    essays = streaming_documents(tokenizer, 2, 300)
    assert [ids.shape for _, ids in essays] == [(1, 300)] * 2 and essays[0][0] != essays[1][0]
    assert int(essays[0][1][0, 0]) == tokenizer.bos_token_id
    needles = streaming_documents(tokenizer, 2, 200, source="needles")
    assert [ids.shape for _, ids in needles] == [(1, 200)] * 2 and not torch.equal(needles[0][1], needles[1][1])
    with pytest.raises(ValueError, match="unknown document source"):
        streaming_documents(tokenizer, 1, 100, source="noise")
    run = StreamRun("x", "kvsieve", 2, [np.r_[math.nan, np.ones(7)]], tokens=8)
    report = StreamResult(["a"], 8, 2, 4, 8, [run]).to_json()
    assert plot_stream_ppl(report, tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_errors():
    result = runner.invoke(app, ["ppl", "--stream", "--max-tokens", "512", "--rates", "0.5"])
    assert result.exit_code != 0 and "--max-tokens (streaming budgets) and --rates" in result.output
    result = runner.invoke(app, ["ppl", "--stream", "--policies", "streaming"])
    assert result.exit_code != 0 and "--stream needs budgets" in result.output
    result = runner.invoke(app, ["ppl", "--max-tokens", "512"])
    assert result.exit_code != 0 and "only apply with --stream" in result.output
    result = runner.invoke(app, ["ppl", "--stream", "--max-tokens", "512,x"])
    assert result.exit_code != 0 and "cannot read '512,x'" in result.output


@needs_kvpress
def test_cli_stream_budget_below_protection_and_a_run(model_dir, tmp_path):
    args = ["ppl", "--stream", "--model", str(model_dir), "--doc-tokens", "160", "--docs", "2", "--buffer", "16"]
    result = runner.invoke(app, [*args, "--max-tokens", "16,64", "--policies", "streaming"])
    assert result.exit_code != 0 and "max_tokens=16 is smaller than the 33 protected entries" in result.output
    out = tmp_path / "stream.json"
    result = runner.invoke(
        app, [*args, "--max-tokens", "48,64", "--policies", "streaming,kvpress:knorm", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [(r["policy"], r["budget"]) for r in report["rows"]] == [
        ("full", None),
        ("streaming", 48),
        ("streaming", 64),
        ("kvpress:knorm", 48),
        ("kvpress:knorm", 64),
    ]
    assert report["docs"] == 2 and report["doc_tokens"] == 160 and "Streaming perplexity" in result.output
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
