"""Answer scoring, responding from a cache, and the resumable task sweep, on a tiny model and tokenizer."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import DynamicCache

import kvsieve
from extras import needs_kvpress
from kvsieve.harness.data.sample import TaskSample, encode
from kvsieve.harness.eval.answers import gold_statistics, is_abstention, judge, string_match
from kvsieve.harness.eval.contenders import parse_contenders
from kvsieve.harness.eval.respond import respond
from kvsieve.harness.eval.results_log import read_rows
from kvsieve.harness.eval.sweep import run_sweep, sample_key, split_prompt
from kvsieve.harness.runners import LocalRunner
from kvsieve.selection.errors import PolicyError

FILLER = "The grass is green. The sky is blue. Here we go. There and back again. "


def make_sample(index: int, number: str = "1234567", abstain: bool = False) -> TaskSample:
    needle = f"The special magic number for apple is: {number}. "
    context = FILLER * 3 + needle + FILLER * 2
    start = context.index(needle)
    return TaskSample(
        task="toy",
        suite="ruler",
        index=index,
        context=context,
        question="What is the special magic number for apple?",
        answer_prefix="The special magic number for apple is:",
        answers=(number,),
        gold=f" {number}",
        evidence=((start, start + len(needle)),),
        abstain_ok=abstain,
        max_new_tokens=6,
    )


def test_string_match_and_verdicts():
    assert string_match("It is 1234567 and 89.", ("1234567", "89")) == 100.0
    assert string_match("It is 1234567.", ("1234567", "89")) == 50.0
    assert string_match("APPLE pie", ("apple",)) == 100.0
    assert is_abstention("I don't know.") and is_abstention("The text does not mention it") and is_abstention("  ")
    assert not is_abstention("It is 42.")
    sample = make_sample(0)
    right, wrong, shrug = judge(" 1234567", sample), judge("7654321", sample), judge("I do not know", sample)
    assert (right.correct, right.hallucinated, right.abstained) == (True, False, False)
    assert (wrong.correct, wrong.hallucinated, wrong.abstained) == (False, True, False)
    assert (shrug.correct, shrug.hallucinated, shrug.abstained) == (False, False, True)
    unanswerable = make_sample(0, abstain=True)
    assert judge("I don't know", unanswerable).correct and not judge("1234567", unanswerable).correct
    assert judge("1234567", unanswerable).hallucinated


def test_gold_statistics_against_manual():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.1, 0.2, 2.0]])
    gold = torch.tensor([2, 3])
    logprob, rank = gold_statistics(logits, gold)
    rows = logits.tolist()
    manual = sum(math.log(math.exp(row[g]) / sum(math.exp(v) for v in row)) for row, g in zip(rows, gold, strict=True))
    assert logprob == pytest.approx(manual)
    assert rank == 2  # 2.0 is beaten by 3.0 only


@torch.no_grad()
def test_respond_full_cache_equals_plain_transformers(lm, tok):
    encoded = encode(make_sample(0), tok)
    prefilled, prompt = split_prompt(encoded, "agnostic")
    prefill = kvsieve.observe_prefill(lm, prefilled)
    [response] = respond(lm, prefill.cache, prompt, encoded.gold_ids, max_new_tokens=6, eos_token_id=-1)

    assert lm.config._attn_implementation == "sdpa"  # the observed prefill gave the model its attention back
    whole = torch.cat([prompt, encoded.gold_ids], dim=-1)
    logits = lm(whole).logits[0].double()
    g = encoded.gold_ids.shape[1]
    expected_logprob = float(torch.log_softmax(logits[-g - 1 : -1], -1).gather(-1, encoded.gold_ids[0, :, None]).sum())
    assert response.gold_logprob == pytest.approx(expected_logprob, rel=1e-5)
    expected = lm.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        past_key_values=DynamicCache(),
        max_new_tokens=6,
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=0,
    )
    assert torch.equal(response.tokens, expected[0, prompt.shape[1] :])


def test_parse_contenders():
    names = [c.name for c in parse_contenders("snapkv+adaptive:window=16,kernel=7,random")]
    assert names == ["full", "snapkv+adaptive:window=16,kernel=7", "random"]
    assert parse_contenders("full,random")[0].is_full
    with pytest.raises(PolicyError, match="unknown policy"):
        parse_contenders("nonsense")
    with pytest.raises(PolicyError, match="distinct"):
        parse_contenders("random,random")
    with pytest.raises(PolicyError, match="unknown kvpress press"):
        parse_contenders("kvpress:nonsense")


@torch.no_grad()
def test_sweep_rows_match_direct_compression(lm, tok, tmp_path):
    samples = [make_sample(0), make_sample(1, "7654321")]
    rows = run_sweep(LocalRunner(lm, tok), samples, "snapkv,random", [0.5, 0.9], results=tmp_path / "r.jsonl")
    assert len(rows) == 2 * (1 + 2 * 2)
    by = {(r.index, r.policy, r.rate): r for r in rows.itertuples()}
    for index, sample in enumerate(samples):
        encoded = encode(sample, tok)
        full = kvsieve.observe_prefill(lm, encoded.context_ids).cache
        assert by[index, "full", 0.0].kv_bytes == full.nbytes() == by[index, "full", 0.0].kv_bytes_full
        for rate in (0.5, 0.9):
            cache = kvsieve.compress(lm, encoded.context_ids, "snapkv", rate=rate)
            row = by[index, "snapkv", rate]
            assert row.kv_bytes == cache.nbytes()
            assert row.kept_entries == sum(map(sum, cache.stored_lengths()))
            prompt = torch.cat([encoded.context_ids, encoded.question_ids], -1)
            with kvsieve.sieve_attention(lm):
                [response] = respond(
                    lm, cache, prompt, encoded.gold_ids, sample.max_new_tokens, rank_index=encoded.gold_content_index
                )
            assert row.gold_logprob == pytest.approx(response.gold_logprob)
            assert row.output == tok.decode(response.tokens, skip_special_tokens=True).strip()
        assert by[index, "snapkv", 0.9].kv_bytes < by[index, "snapkv", 0.5].kv_bytes < by[index, "full", 0.0].kv_bytes
        # the full cache evicts no evidence; GER is a share
        assert by[index, "full", 0.0].ger_layer == 0.0
        assert 0.0 <= by[index, "random", 0.9].ger_layer <= 1.0
    assert set(rows["sample"]) == {sample_key(s) for s in samples}


@torch.no_grad()
def test_batched_sweep_equals_one_configuration_at_a_time(lm, tok):
    """Answering a sample's kvsieve configurations as one batch gives the rows of answering them one by one."""
    samples = [make_sample(0), make_sample(1, "7654321")]
    policies, rates, modes = "snapkv,knorm,random,importance", [0.5, 0.9], ("agnostic", "aware")
    batched = run_sweep(LocalRunner(lm, tok), samples, policies, rates, modes=modes)
    single = run_sweep(LocalRunner(lm, tok), samples, policies, rates, modes=modes, rows_per_pass=1)
    assert len(batched) == len(single) == 2 * 2 * (1 + 4 * 2)
    key = ["sample", "mode", "policy", "rate"]
    batched, single = batched.set_index(key).sort_index(), single.set_index(key).sort_index()
    assert list(batched.index) == list(single.index)
    assert (batched["output"] == single["output"]).all()
    assert (batched["kept_entries"] == single["kept_entries"]).all()
    assert (batched["kv_bytes"] == single["kv_bytes"]).all()
    assert (batched["gold_rank"] == single["gold_rank"]).all()
    assert batched["gold_logprob"].to_numpy() == pytest.approx(single["gold_logprob"].to_numpy(), abs=1e-5)
    # the rows differ from each other, so a batch answering every row alike would not pass
    assert batched["kv_bytes"].nunique() > 2 and batched["gold_logprob"].nunique() > len(batched) // 2


@torch.no_grad()
def test_sweep_resumes_where_it_stopped(lm, tok, tmp_path):
    path = tmp_path / "results.jsonl"
    samples = [make_sample(0), make_sample(1, "7654321")]
    first = run_sweep(LocalRunner(lm, tok), samples[:1], "random", [0.5], results=path)
    assert len(first) == 2 and len(read_rows(path)) == 2
    # an interrupted write leaves half a line: it is dropped and that configuration runs again
    lines = path.read_text().splitlines()
    path.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])
    seen = []
    again = run_sweep(
        LocalRunner(lm, tok), samples, "random", [0.5], results=path, progress=lambda d, t: seen.append((d, t))
    )
    assert len(again) == 4
    assert seen[0] == (1, 4) and seen[-1] == (4, 4)  # one row was already done
    keys = [(r["sample"], r["policy"]) for r in read_rows(path)]
    assert len(keys) == len(set(keys)) == 4
    # nothing left to do: no prefill, no new row
    third = run_sweep(LocalRunner(lm, tok), samples, "random", [0.5], results=path)
    assert len(third) == 4 and len(path.read_text().splitlines()) == 5  # 4 rows + the broken half line
    assert json.loads(path.read_text().splitlines()[0])["policy"] == "full"


@torch.no_grad()
def test_question_aware_protects_the_question_and_evicts_as_many(lm, tok):
    sample = make_sample(0)
    rows = run_sweep(LocalRunner(lm, tok), [sample], "snapkv", [0.8], modes=("agnostic", "aware"))
    by = {(r.mode, r.policy): r for r in rows.itertuples()}
    encoded = encode(sample, tok)
    q = encoded.question_ids.shape[1]
    # the aware cache holds the question (all but the last token) on top of the same number of context entries
    per_entry = by["agnostic", "full"].kv_bytes // encoded.context_length
    assert by["aware", "snapkv"].kv_bytes - by["agnostic", "snapkv"].kv_bytes == per_entry * (q - 1)
    assert by["aware", "snapkv"].kept_entries == by["agnostic", "snapkv"].kept_entries


def test_sweep_rejects_bad_input(lm, tok):
    with pytest.raises(ValueError, match="unknown mode"):
        run_sweep(LocalRunner(lm, tok), [make_sample(0)], "random", [0.5], modes=("sideways",))
    with pytest.raises(PolicyError, match=r"\[0, 1\)"):
        run_sweep(LocalRunner(lm, tok), [make_sample(0)], "random", [1.0])


@torch.no_grad()
def test_respond_in_chunks_is_exact(lm, tok):
    encoded = encode(make_sample(0), tok)
    prompt = torch.cat([encoded.context_ids, encoded.question_ids], -1)
    whole_cache = kvsieve.compress(lm, encoded.context_ids, "snapkv", rate=0.5)
    cache = kvsieve.compress(lm, encoded.context_ids, "snapkv", rate=0.5)
    with kvsieve.sieve_attention(lm):
        [whole] = respond(lm, whole_cache, prompt, encoded.gold_ids, 6)
        [chunked] = respond(lm, cache, prompt, encoded.gold_ids, 6, max_feed=3)
    assert torch.equal(whole.tokens, chunked.tokens)
    assert chunked.gold_logprob == pytest.approx(whole.gold_logprob, rel=1e-5)


@needs_kvpress
@torch.no_grad()
def test_sweep_runs_kvpress_side_by_side(lm, tok):
    sample = make_sample(0)
    policies = "snapkv,kvpress:snapkv,kvpress:adakv_expected_attention"
    rows = run_sweep(LocalRunner(lm, tok), [sample], policies, [0.6])
    by = {r.policy: r for r in rows.itertuples()}
    assert by["kvpress:snapkv"].library == by["kvpress:adakv_expected_attention"].library == "kvpress"
    # same number of entries at one rate; kvpress's AdaKV only masks, so it holds every byte
    assert by["kvpress:snapkv"].kept_entries == by["snapkv"].kept_entries
    assert by["kvpress:adakv_expected_attention"].kept_entries == by["snapkv"].kept_entries
    assert by["kvpress:snapkv"].kv_bytes == by["snapkv"].kv_bytes < by["full"].kv_bytes
    assert by["kvpress:adakv_expected_attention"].kv_bytes == by["full"].kv_bytes
    # the question (longer than half a head dimension) was fed in chunks for AdaKV
    assert encode(sample, tok).question_ids.shape[1] > lm.config.head_dim // 2
    assert all(math.isfinite(r.gold_logprob) for r in rows.itertuples())
    # kvsieve still works on the same model afterwards
    assert (
        run_sweep(LocalRunner(lm, tok), [sample], "snapkv", [0.6]).set_index("policy").loc["snapkv", "output"]
        == by["snapkv"].output
    )


@torch.no_grad()
def test_reprefill_gives_the_same_rows(lm, tok):
    samples = [make_sample(0)]
    once = run_sweep(LocalRunner(lm, tok), samples, "snapkv,importance", [0.5, 0.9]).set_index(["policy", "rate"])
    again = run_sweep(LocalRunner(lm, tok), samples, "snapkv,importance", [0.5, 0.9], reprefill=True).set_index(
        ["policy", "rate"]
    )
    assert list(once.index) == list(again.index)
    assert (once["output"] == again["output"]).all() and (once["kv_bytes"] == again["kv_bytes"]).all()
    assert once["gold_logprob"].to_numpy() == pytest.approx(again["gold_logprob"].to_numpy(), rel=1e-6)
    # every configuration paid its own prefill: no share of one prefill
    assert (again["wall_seconds"] - again["seconds"] == again["prefill_seconds"]).all()
