"""RULER-style task generators: sizes measured with `encode`, answers recomputed from the context text."""

from __future__ import annotations

import math
import re
from collections import Counter
from functools import cache

import pytest

from kvsieve.harness.data import haystack as hs
from kvsieve.harness.data.ruler import RULER_TASKS, ruler_samples, zeta, zipf_counts
from kvsieve.harness.data.sample import TaskSample, encode, merge_spans, token_count
from tokenizer import tiny_tokenizer

#: Target lengths for the tiny tokenizer (its merges are few, so vt/cwe/uuid needles cost many tokens).
LENGTHS = {"vt": 1024, "cwe": 2048, "niah_multikey_3": 1024}
N = 3
NEEDLE_RE = re.compile(r"One of the special magic (\w+) for (\S+) is: (\S+?)\.(?=\s|$)")


def length_for(task: str) -> int:
    return LENGTHS.get(task, 512)


@cache
def samples(task: str, seed: int = 0, n: int = N) -> tuple[TaskSample, ...]:
    return tuple(ruler_samples(task, tiny_tokenizer(), length_for(task), n=n, seed=seed))


def prompt_length(sample: TaskSample, tokenizer=None) -> int:
    enc = encode(sample, tokenizer or tiny_tokenizer())
    return enc.context_length + enc.question_ids.shape[1]


# ---------------------------------------------------------------- independent recomputation of answers


def niah_expected(sample: TaskSample) -> set[str]:
    """Values of every needle whose key the question asks about, read off the context."""
    asked = re.search(r"magic \w+ for (.+) mentioned in the provided text\?", sample.question).group(1)
    keys = set(re.split(r", and |, ", asked))
    return {value for _, key, value in NEEDLE_RE.findall(sample.context) if key in keys}


def vt_expected(sample: TaskSample) -> set[str]:
    """Follow the assignment chain from the value the question names."""
    value = re.search(r"assigned the value (\d+) in the text above", sample.question).group(1)
    direct = dict(re.findall(r"VAR ([A-Z]+) = (\d+)(?!\d)", sample.context))
    copies = re.findall(r"VAR ([A-Z]+) = VAR ([A-Z]+)", sample.context)
    found = {name for name, v in direct.items() if v == value}
    while True:
        more = {dst for dst, src in copies if src in found} - found
        if not more:
            return found
        found |= more


def cwe_counts(sample: TaskSample) -> Counter:
    main = sample.context.rsplit("Memorize the ones that appear most often.\n", 1)[1]
    return Counter(re.findall(r"\d+\. (\w+)", main))


def fwe_counts(sample: TaskSample) -> Counter:
    coded = sample.context.split("coded words. ", 1)[1]
    return Counter(w for w in coded.split() if w != "...")


def top_with_gap(counts: Counter, k: int) -> set[str]:
    ranked = counts.most_common()
    assert ranked[k - 1][1] > (ranked[k][1] if len(ranked) > k else 0), "the top words are not separated"
    return {w for w, _ in ranked[:k]}


def expected_answers(sample: TaskSample) -> set[str]:
    if sample.task.startswith("niah"):
        return niah_expected(sample)
    if sample.task == "vt":
        return vt_expected(sample)
    if sample.task == "cwe":
        return top_with_gap(cwe_counts(sample), 10)
    return top_with_gap(fwe_counts(sample), 3)


# ---------------------------------------------------------------- every task


@pytest.mark.parametrize("task", RULER_TASKS)
def test_deterministic_by_seed_and_varied_by_index(task: str) -> None:
    first = samples(task)
    again = ruler_samples(task, tiny_tokenizer(), length_for(task), n=N, seed=0)
    assert [(s.context, s.answers, s.evidence, s.question) for s in first] == [
        (s.context, s.answers, s.evidence, s.question) for s in again
    ]
    other = ruler_samples(task, tiny_tokenizer(), length_for(task), n=1, seed=1)[0]
    assert other.answers != first[0].answers
    assert len({s.answers for s in first}) == N
    assert [s.index for s in first] == list(range(N))
    assert all(s.suite == "ruler" and s.task == task for s in first)


@pytest.mark.parametrize("task", RULER_TASKS)
def test_length_window_measured_with_encode(task: str) -> None:
    target = length_for(task)
    for sample in samples(task):
        assert 0.9 * target <= prompt_length(sample) <= target


@pytest.mark.parametrize("task", RULER_TASKS)
def test_answers_recomputed_from_context(task: str) -> None:
    for sample in samples(task):
        assert expected_answers(sample) == set(sample.answers)
        assert len(set(sample.answers)) == len(sample.answers)
        for answer in sample.answers:
            assert answer in sample.context
            assert answer in sample.gold
        assert sample.gold.startswith(" ")
        assert sample.max_new_tokens >= token_count(tiny_tokenizer(), sample.gold)


@pytest.mark.parametrize("task", RULER_TASKS)
def test_evidence_spans_hold_the_answers(task: str) -> None:
    for sample in samples(task):
        texts = [sample.context[a:b] for a, b in sample.evidence]
        assert texts
        joined = " ".join(texts)
        assert all(answer in joined for answer in sample.answers)
        if task.startswith("niah"):
            # only the asked needles, each a whole needle sentence
            assert len(texts) == len(sample.answers)
            assert all(NEEDLE_RE.fullmatch(t) for t in texts)
        elif task == "vt":
            assert len(texts) == 5
            assert all(re.fullmatch(r"VAR [A-Z]{5} = (\d{5}|VAR [A-Z]{5})", t) for t in texts)
        else:
            counts = cwe_counts(sample) if task == "cwe" else fwe_counts(sample)
            assert set(texts) == set(sample.answers)
            assert len(texts) == sum(counts[a] for a in sample.answers)
        assert all(0.0 <= d <= 1.0 for d in sample.meta["evidence_depths"])


@pytest.mark.parametrize("task", RULER_TASKS)
def test_evidence_positions_decode_to_the_evidence(task: str) -> None:
    tok = tiny_tokenizer()
    for sample in samples(task):
        enc = encode(sample, tok)
        positions = enc.evidence_positions
        assert positions.numel() > 0
        decoded = tok.decode(enc.context_ids[0, positions])
        spans = [sample.context[a:b] for a, b in sample.evidence]
        assert all(text in decoded for text in spans)
        # little more than the evidence: at most a few boundary characters per span
        assert len(decoded) <= sum(len(t) for t in spans) + 3 * len(spans)


@pytest.mark.parametrize("task", RULER_TASKS)
def test_candidates_are_the_unasked_needles_values(task: str) -> None:
    tok = tiny_tokenizer()
    for sample in samples(task):
        enc = encode(sample, tok)
        assert [ids[0].tolist() for ids in enc.candidate_ids] == [
            tok(c, add_special_tokens=False).input_ids for c in sample.candidates
        ]
        if not task.startswith("niah_multikey"):
            assert sample.candidates == ()  # no needle with another key, or several answers at once
            continue
        asked = niah_expected(sample)
        others = {value for _, _, value in NEEDLE_RE.findall(sample.context)} - asked
        assert sample.candidates and sample.gold not in sample.candidates
        assert len(set(sample.candidates)) == len(sample.candidates)
        assert all(c.startswith(" ") and c.strip() in sample.context for c in sample.candidates)
        assert {c.strip() for c in sample.candidates} == others
        if task == "niah_multikey_1":
            assert len(sample.candidates) == 3  # the three inserted needles with other keys
        else:  # the needle haystack: every line is a distractor needle
            assert len(sample.candidates) == sample.meta["haystack_units"]


@pytest.mark.parametrize("task", RULER_TASKS)
def test_evidence_spans_cover_the_evidence_positions(task: str) -> None:
    tok = tiny_tokenizer()
    for sample in samples(task):
        enc = encode(sample, tok)
        assert len(enc.evidence_spans) == len(merge_spans(sample.evidence))
        assert all(0 <= a < b <= enc.context_length for a, b in enc.evidence_spans)
        covered = sorted({i for a, b in enc.evidence_spans for i in range(a, b)})
        assert covered == enc.evidence_positions.tolist()


# ---------------------------------------------------------------- task specifics


def test_niah_configurations_follow_ruler() -> None:
    nouns, adjs = set(hs.wonderwords_list("nounlist")), set(hs.wonderwords_list("adjectivelist"))
    for sample in samples("niah_single_1"):
        key = sample.meta["queries"][0]
        adj, noun = key.split("-")
        assert adj in adjs and noun in nouns
        assert re.fullmatch(r"\d{7}", sample.answers[0])
        assert sample.context.count(hs.NOISE) >= 3  # the noise haystack
        assert sample.answer_prefix.endswith("mentioned in the provided text is")
    for sample in samples("niah_single_3"):
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", sample.answers[0])
    for sample in samples("niah_multikey_1"):
        assert len(NEEDLE_RE.findall(sample.context)) == 4 and len(sample.answers) == 1
    for sample in samples("niah_multikey_2"):  # needles only: every line is a needle
        lines = sample.context.split("\n")[1:]
        assert len(lines) > 5 and all(NEEDLE_RE.fullmatch(line) for line in lines)
        assert len({k for _, k, _ in NEEDLE_RE.findall(sample.context)}) == len(lines)  # the asked key is unique
    for sample in samples("niah_multikey_3"):
        assert all(len(k) == 36 for _, k, _ in NEEDLE_RE.findall(sample.context))
    for sample in samples("niah_multivalue"):
        assert len(sample.answers) == 4 and len(set(sample.meta["queries"])) == 1
        assert sample.answer_prefix.endswith("are")
    for sample in samples("niah_multiquery"):
        assert len(sample.answers) == 4 and len(set(sample.meta["queries"])) == 4


def test_needle_depths_spread_over_the_context() -> None:
    depths = [d for s in ruler_samples("niah_single_2", tiny_tokenizer(), 512, n=10) for d in s.meta["evidence_depths"]]
    assert len(set(depths)) >= 6
    assert max(depths) - min(depths) > 0.4


def test_cwe_repeats_switch_at_4k() -> None:
    short = samples("cwe")[0]
    counts = cwe_counts(short)
    assert {counts[a] for a in short.answers} == {6}
    assert {c for w, c in counts.items() if w not in short.answers} == {1}
    long = ruler_samples("cwe", tiny_tokenizer(), 8192, n=1)[0]
    counts = cwe_counts(long)
    assert {counts[a] for a in long.answers} == {30}
    assert {c for w, c in counts.items() if w not in long.answers} == {3}
    assert 0.9 * 8192 <= prompt_length(long) <= 8192


def test_fwe_counts_follow_zipf() -> None:
    assert zeta(2.0) == pytest.approx(math.pi**2 / 6, rel=1e-9)
    assert zeta(4.0) == pytest.approx(math.pi**4 / 90, rel=1e-9)
    assert zipf_counts(1000, 4, 2.0) == [int(1000 / (k * k) / (math.pi**2 / 6)) for k in range(1, 5)]
    sample = samples("fwe")[0]
    counts = fwe_counts(sample)
    total = sample.meta["haystack_units"]
    expected = sorted(
        (int(total / k**2 / (math.pi**2 / 6)) for k in range(2, sample.meta["vocab_size"] + 1)), reverse=True
    )
    assert sorted(counts.values(), reverse=True) == [c for c in expected if c > 0]


def test_unknown_task_and_too_small_length() -> None:
    with pytest.raises(ValueError, match=r"niah_single_1.*fwe"):
        ruler_samples("niah_single_9", tiny_tokenizer())
    for task in ("niah_single_1", "vt", "cwe"):
        with pytest.raises(ValueError, match="too small"):
            ruler_samples(task, tiny_tokenizer(), length=60, n=1)


# ---------------------------------------------------------------- haystacks


@pytest.mark.parametrize("n_tokens", [50, 300])
def test_haystacks_fill_the_token_budget(n_tokens: int) -> None:
    tok = tiny_tokenizer()
    noise = hs.noise_haystack(tok, n_tokens)
    assert token_count(tok, noise) <= n_tokens < token_count(tok, noise + hs.LINE_SEP + hs.NOISE)
    essay = hs.essay_haystack(tok, n_tokens)
    words = essay.split()
    assert words == list(hs.essay_words()[: len(words)])
    longer = " ".join(hs.essay_words()[: len(words) + 1])
    assert token_count(tok, essay) <= n_tokens < token_count(tok, longer)
    needles = hs.needle_haystack(tok, n_tokens, seed=3, exclude=frozenset({"x"}))
    lines = needles.split(hs.LINE_SEP)
    assert all(NEEDLE_RE.fullmatch(line) for line in lines)
    assert lines == hs.needle_units(len(lines), seed=3, exclude=frozenset({"x"}))
    assert token_count(tok, needles) <= n_tokens < token_count(tok, "\n".join(hs.needle_units(len(lines) + 1, 3)))


def test_largest_fitting_matches_brute_force() -> None:
    for limit in (0, 1, 7, 64, 65, 1000, 4097):
        for guess in (None, 0, 3, 500, 9000):
            for cap in (None, 5000):
                got = hs.largest_fitting(lambda n, lim=limit: n <= lim, guess=guess, cap=cap)
                assert got == (limit if cap is None else min(limit, cap))
    with pytest.raises(ValueError):
        hs.largest_fitting(lambda n: n < 3, lo=5)


# ---------------------------------------------------------------- the default model


@pytest.mark.integration
def test_default_tokenizer_length_window() -> None:
    import kvsieve

    _, tok = kvsieve.load_model()
    for task in ("niah_single_2", "vt"):
        for sample in ruler_samples(task, tok, 2048, n=2):
            enc = encode(sample, tok)  # with the chat template
            assert 0.9 * 2048 <= enc.context_length + enc.question_ids.shape[1] <= 2048
            assert expected_answers(sample) == set(sample.answers)
            assert enc.evidence_positions.numel() > 0
