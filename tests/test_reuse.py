"""Compress once, ask many: question sets, the needle formats the gates never saw, and answers from one compressed
cache equal to compressing again for every question (the cache is not changed by answering)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from kvsieve.harness.data import resolve_tasks, task_samples
from kvsieve.harness.data.question_sets import QUESTION_SET_TASKS, question_set, question_sets
from kvsieve.harness.data.ruler import NIAH_CONFIGS, RULER_FORMAT, UNSEEN_TASKS
from kvsieve.harness.data.sample import encode
from kvsieve.harness.eval.contenders import contender
from kvsieve.harness.eval.methods import build
from kvsieve.harness.eval.respond import fork
from kvsieve.harness.eval.reuse import answer_from_copy, run_reuse, without_question
from kvsieve.harness.eval.sweep import sample_case
from kvsieve.harness.runners import LocalRunner
from kvsieve.harness.training.data import TRAINING_TASKS
from kvsieve.runtime.attention.sieve import sieve_attention
from tokenizer import VOCAB_SIZE

LENGTH = 640


def _sets(tok, tasks: str, n: int = 1) -> list:
    return question_sets(tasks, tok, length=LENGTH, n=n, chat=False)


# ---------------------------------------------------------------- the data


@pytest.mark.parametrize("task", QUESTION_SET_TASKS)
def test_every_question_is_answered_by_its_own_statement(tok, task):
    (original,) = task_samples(task, tok, length=LENGTH, n=1, chat=False)
    questions = question_set(original)
    meta = original.meta
    expected = {"multi_entity": len(meta.get("entities", ())), "hops": 2 * meta.get("hops", 0)}.get(task, 4)
    assert len(questions) == expected
    assert {q.context for q in questions} == {original.context}
    assert original.question in {q.question for q in questions}  # the generated question is one of the set
    assert len({q.question for q in questions}) == len(questions)
    for q in questions:
        statement = " ".join(q.context[start:end] for start, end in q.evidence)  # one, or a hops chain's links
        (answer,) = q.answers
        assert answer in statement and q.gold == f" {answer}" and f" {answer}" not in q.candidates
        subject = q.meta.get("entity") or q.meta["queries"][0]
        assert subject in statement and subject in q.question


def test_question_sets_refuse_a_task_without_several_questions(tok):
    (sample,) = task_samples("niah_single_1", tok, length=LENGTH, n=1, chat=False)
    with pytest.raises(ValueError, match="niah_single_1: no question set; tasks whose contexts answer"):
        question_set(sample)


def test_unseen_needle_formats_are_kept_out_of_gate_training(tok):
    assert not set(resolve_tasks(TRAINING_TASKS)) & set(UNSEEN_TASKS)
    assert resolve_tasks("unseen") == list(UNSEEN_TASKS)
    ruler_phrases = ("special magic", RULER_FORMAT.sentence.split("{")[0])
    for sample in task_samples("unseen", tok, length=LENGTH, n=2, chat=False):
        fmt = NIAH_CONFIGS[sample.task].format
        assert sample.suite == "unseen" and fmt is not RULER_FORMAT
        text = sample.context + sample.question + sample.answer_prefix
        assert not any(phrase in text for phrase in ruler_phrases)
        needles = [fmt.needle(k, v[0], NIAH_CONFIGS[sample.task].value_type) for k, v in zip(
            sample.meta["keys"], sample.meta["values"], strict=True)]  # fmt: skip
        assert all(sample.context.count(needle) == 1 for needle in needles)


# ---------------------------------------------------------------- answers from one compressed cache


def _one_at_a_time(model, tok, question, policy: str, rate: float) -> tuple[str, float]:
    """Compress the context again for this one question and answer it from that cache itself."""
    encoded = encode(question, tok, chat=False)
    method = contender(policy)
    compressed = build(model, sample_case(encoded, "agnostic", method.needs, tok), [(method, rate)])
    prompt = torch.cat([encoded.context_ids, encoded.question_ids], dim=-1)
    (response,) = compressed.answer(
        model, prompt, encoded.gold_ids, question.max_new_tokens, encoded.gold_content_index
    )
    return tok.decode(response.tokens, skip_special_tokens=True).strip(), response.gold_logprob


@torch.no_grad()
def test_reuse_answers_equal_one_question_at_a_time(tok):
    model = tiny_llama(vocab_size=VOCAB_SIZE).double()
    sets = _sets(tok, "niah_multikey_1,hops")
    policies = ["snapkv", "kvzip+global", "knorm+adaptive"]
    rows = run_reuse(LocalRunner(model, tok), sets, policies, [0.5, 0.8], chat=False)
    assert len(rows) == (1 + len(policies) * 2) * sum(len(s) for s in sets)
    assert rows.groupby(["context", "policy", "rate"])["question"].nunique().min() == min(len(s) for s in sets)
    by_context = {s[0].task: s for s in sets}
    for row in rows[rows["policy"] != "full"].itertuples():
        question = by_context[row.task][row.question]
        output, logprob = _one_at_a_time(model, tok, question, row.policy, row.rate)
        assert row.output == output, (row.policy, row.rate, row.question)
        assert row.gold_logprob == pytest.approx(logprob, abs=1e-9)


@torch.no_grad()
def test_answering_leaves_the_compressed_cache_unchanged(tok):
    model = tiny_llama(vocab_size=VOCAB_SIZE).double()
    (questions,) = _sets(tok, "niah_multikey_1")
    encoded = [encode(q, tok, chat=False) for q in questions]
    methods = [(contender("snapkv"), 0.5), (contender("knorm"), 0.7)]
    compressed = build(model, sample_case(encoded[0], "agnostic", methods[0][0].needs, tok), methods)
    cache = compressed.cache
    length, kept = cache.get_seq_length(), [cache.kept_positions(layer, 1) for layer in range(3)]

    def probe() -> torch.Tensor:
        with sieve_attention(model):
            return model(input_ids=encoded[0].question_ids.expand(2, -1), past_key_values=fork(cache)).logits

    before = probe()
    for question in encoded[1:]:
        answer_from_copy(model, compressed, question)
    assert cache.get_seq_length() == length
    after = [cache.kept_positions(layer, 1) for layer in range(3)]
    assert all(
        torch.equal(a, b)
        for layer_a, layer_b in zip(kept, after, strict=True)
        for a, b in zip(layer_a, layer_b, strict=True)
    )
    assert torch.equal(probe(), before)
    prompt = torch.cat([encoded[1].context_ids, encoded[1].question_ids], dim=-1)
    compressed.answer(model, prompt, encoded[1].gold_ids, 4, 0)  # answering from the cache itself grows it
    assert cache.get_seq_length() > length


@torch.no_grad()
def test_first_question_compression_keeps_only_the_context(tok):
    model = tiny_llama(vocab_size=VOCAB_SIZE).double()
    (questions,) = _sets(tok, "niah_multikey_1")
    encoded = encode(questions[0], tok, chat=False)
    snapkv = contender("snapkv")
    aware = build(model, sample_case(encoded, "aware", snapkv.needs, tok), [(snapkv, 0.6)])
    n = encoded.context_length
    kept = [[p[p < n] for p in aware.cache.kept_positions(layer)] for layer in range(3)]
    bytes_with_question = aware.kv_bytes[0]
    dropped = without_question(aware, n)
    assert dropped.cache.get_seq_length() == n
    assert dropped.kv_bytes[0] < bytes_with_question
    for layer in range(3):
        for want, got in zip(kept[layer], dropped.cache.kept_positions(layer), strict=True):
            assert torch.equal(want, got)
    agnostic = build(model, sample_case(encoded, "agnostic", snapkv.needs, tok), [(snapkv, 0.6)])
    assert any(
        not torch.equal(a, b)
        for layer in range(3)
        for a, b in zip(agnostic.cache.kept_positions(layer), kept[layer], strict=True)
    ), "the first question should change what snapkv keeps"
    rows = run_reuse(LocalRunner(model, tok), [questions], [], [0.6], first_question=["snapkv"], chat=False)
    assert set(rows["compressed_with"]) == {"context", "first_question"}
    with pytest.raises(ValueError, match="first_question takes kvsieve policies only"):
        run_reuse(LocalRunner(model, tok), [questions], [], [0.6], first_question=["kvpress:knorm"])


@torch.no_grad()
def test_a_rerun_on_the_same_results_file_runs_nothing_again(tok, tmp_path):
    model = tiny_llama(vocab_size=VOCAB_SIZE)
    sets, path = _sets(tok, "multi_entity"), tmp_path / "reuse.jsonl"
    first = run_reuse(LocalRunner(model, tok), sets, ["knorm"], [0.5], results=path, chat=False)
    lines = path.read_text().count("\n")
    again = run_reuse(LocalRunner(model, tok), sets, ["knorm", "random"], [0.5], results=path, chat=False)
    added = path.read_text().count("\n") - lines
    assert added == len(sets[0]) and len(again) == len(first) + added  # only random's rows are new
