"""Gold-answer margins from a cache equal the log-probabilities of a plain forward without any cache."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from transformers import DynamicCache

import kvsieve
from conftest import tiny_llama
from kvsieve.harness.data.sample import EncodedSample, TaskSample, encode
from kvsieve.harness.eval.margins import Margin, margins
from kvsieve.runtime.api.evictions import Eviction, evictions
from tokenizer import VOCAB_SIZE

FILLER = "The grass is green. The sky is blue. Here we go. There and back again. "
NUMBERS = {"pear": "7654321", "apple": "1234567", "plum": "5550123"}

#: Log-probabilities `[a, vocab]` of the tokens predicting each token of an answer `[1, a]`.
LogProbs = Callable[[torch.Tensor], torch.Tensor]


def make_sample(asked: str, candidates: bool) -> TaskSample:
    """Three needles; `asked`'s number is the gold, the other two compete (when `candidates`)."""
    needles = [f"The special magic number for {fruit} is: {number}. " for fruit, number in NUMBERS.items()]
    context = FILLER * 2 + needles[0] + FILLER + needles[1] + FILLER + needles[2] + FILLER
    needle = needles[list(NUMBERS).index(asked)]
    start = context.index(needle)
    return TaskSample(
        task="toy",
        suite="ruler",
        index=0,
        context=context,
        question=f"What is the special magic number for {asked}?",
        answer_prefix=f"The special magic number for {asked} is:",
        answers=(NUMBERS[asked],),
        gold=f" {NUMBERS[asked]}",
        candidates=tuple(f" {n}" for f, n in NUMBERS.items() if f != asked) if candidates else (),
        evidence=((start, start + len(needle) - 1),),
    )


@pytest.fixture(scope="module")
def lm64():
    """A tiny model in float64, so the cached and the plain forward agree to rounding."""
    return copy.deepcopy(tiny_llama(vocab_size=VOCAB_SIZE)).double()


def prompt_of(encoded: EncodedSample) -> torch.Tensor:
    return torch.cat([encoded.context_ids, encoded.question_ids], dim=-1)


def plain(model: torch.nn.Module, prompt: torch.Tensor) -> LogProbs:
    """Log-probabilities of an answer after the whole prompt, from one forward over prompt + answer."""

    def of(answer: torch.Tensor) -> torch.Tensor:
        logits = model(torch.cat([prompt, answer], dim=-1)).logits[0, prompt.shape[1] - 1 : -1]
        return torch.log_softmax(logits.double(), dim=-1)

    return of


def expected(log_probs: LogProbs, encoded: EncodedSample, tok) -> Margin:
    """The margin computed by hand from teacher-forced log-probabilities."""
    if encoded.candidate_ids:

        def score(ids: torch.Tensor) -> float:
            return float(log_probs(ids).gather(-1, ids[0, :, None]).sum())

        rivals = [score(ids) for ids in encoded.candidate_ids]
        best = max(range(len(rivals)), key=rivals.__getitem__)
        return Margin(score(encoded.gold_ids), encoded.sample.candidates[best], rivals[best], "candidates")
    index = encoded.gold_content_index
    row = log_probs(encoded.gold_ids)[index].clone()
    token = int(encoded.gold_ids[0, index])
    gold = float(row[token])
    row[token] = float("-inf")
    return Margin(gold, tok.decode([int(row.argmax())]), float(row.max()), "first_token")


def assert_same(got: Margin, want: Margin, tol: float = 1e-9) -> None:
    assert (got.kind, got.rival) == (want.kind, want.rival)
    assert got.gold_logprob == pytest.approx(want.gold_logprob, abs=tol)
    assert got.rival_logprob == pytest.approx(want.rival_logprob, abs=tol)
    assert got.margin == pytest.approx(want.margin, abs=2 * tol)


@pytest.mark.parametrize("kind", ["candidates", "first_token"])
@pytest.mark.parametrize("asked", ["apple", "pear"])
@pytest.mark.parametrize("held", ["context", "prompt_but_one"])
@pytest.mark.parametrize("cache_kind", ["sieved", "dynamic"])
@pytest.mark.parametrize("max_feed", [None, 2])
@torch.no_grad()
def test_margins_equal_a_plain_forward(lm64, tok, kind, asked, held, cache_kind, max_feed):
    encoded = encode(make_sample(asked, kind == "candidates"), tok)
    prompt = prompt_of(encoded)
    prefix = encoded.context_ids if held == "context" else prompt[:, :-1]
    if cache_kind == "sieved":
        cache = kvsieve.observe_prefill(lm64, prefix).cache
    else:
        cache = DynamicCache()
        lm64(prefix, past_key_values=cache)
    [got] = margins(lm64, cache, prompt, encoded, max_feed=max_feed, tokenizer=tok)
    assert cache.get_seq_length() == prefix.shape[1]  # the cache itself was not fed
    assert_same(got, expected(plain(lm64, prompt), encoded, tok))
    assert got.kind == kind


@torch.no_grad()
def test_the_samples_exercise_every_case(lm64, tok):
    """`pear`'s gold starts with a bare space token (teacher-forced before the ranked one); `apple`'s does not.
    The gold wins on one sample and loses on the other, to a rival that is not the first candidate on one."""
    assert encode(make_sample("pear", False), tok).gold_content_index == 1
    assert encode(make_sample("apple", False), tok).gold_content_index == 0
    found = {}
    for asked in ("apple", "pear"):
        encoded = encode(make_sample(asked, True), tok)
        cache = kvsieve.observe_prefill(lm64, encoded.context_ids).cache
        [found[asked]] = margins(lm64, cache, prompt_of(encoded), encoded)
    assert found["apple"].margin > 0 > found["pear"].margin
    assert found["apple"].rival == make_sample("apple", True).candidates[1]


@pytest.mark.parametrize("kind", ["candidates", "first_token"])
@torch.no_grad()
def test_each_row_of_a_multi_row_cache_has_its_own_margin(lm64, tok, masked_reference, kind):
    encoded = encode(make_sample("pear", kind == "candidates"), tok)
    prompt, context = prompt_of(encoded), encoded.context_ids
    prefill = kvsieve.observe_prefill(lm64, context)
    cache = evictions(prefill, [Eviction(None), Eviction("snapkv", 0.5)])
    before = cache.copy()
    with kvsieve.sieve_attention(lm64):
        got = margins(lm64, cache, prompt, encoded, tokenizer=tok)
        chunked = margins(lm64, cache, prompt, encoded, max_feed=3, tokenizer=tok)
    assert len(got) == 2
    assert_same(got[0], expected(plain(lm64, prompt), encoded, tok))
    kept = [cache.kept_positions(layer, 1) for layer in range(len(cache.layers))]
    assert sum(p.numel() for heads in kept for p in heads) < sum(map(sum, cache.stored_lengths(0)))

    def masked(answer: torch.Tensor) -> torch.Tensor:
        """Row 1 by hand: the full cache with the evicted positions masked out of attention."""
        with masked_reference(lm64, context, kept) as ref:
            logits = lm64(torch.cat([encoded.question_ids, answer], -1), past_key_values=ref.cache).logits[0]
        return torch.log_softmax(logits[encoded.question_ids.shape[1] - 1 : -1].double(), dim=-1)

    assert_same(got[1], expected(masked, encoded, tok), tol=1e-7)
    assert got[0].gold_logprob != pytest.approx(got[1].gold_logprob, abs=1e-3)  # the eviction matters
    for whole, parts in zip(got, chunked, strict=True):
        assert_same(parts, whole, tol=1e-9)
    # the cache is as it was: same length, same entries, same continuation
    assert cache.get_seq_length() == before.get_seq_length() == context.shape[1]
    assert [cache.stored_lengths(r) for r in range(2)] == [before.stored_lengths(r) for r in range(2)]
    tail = encoded.question_ids.expand(2, -1)
    with kvsieve.sieve_attention(lm64):
        torch.testing.assert_close(
            lm64(tail, past_key_values=cache).logits, lm64(tail, past_key_values=before).logits, rtol=0, atol=0
        )


@torch.no_grad()
def test_float32_model_agrees_with_its_plain_forward(tok):
    """The default dtype: log-softmax in float64 of float32 logits, within float32 rounding."""
    lm = tiny_llama(vocab_size=VOCAB_SIZE)
    for kind in (True, False):
        encoded = encode(make_sample("apple", kind), tok)
        prompt = prompt_of(encoded)
        cache = kvsieve.observe_prefill(lm, encoded.context_ids).cache
        [got] = margins(lm, cache, prompt, encoded, tokenizer=tok)
        assert_same(got, expected(plain(lm, prompt), encoded, tok), tol=1e-4)


@torch.no_grad()
def test_margins_refuse_what_they_cannot_measure(lm64, tok):
    encoded = encode(make_sample("apple", True), tok)
    prompt = prompt_of(encoded)
    full = kvsieve.observe_prefill(lm64, prompt).cache
    with pytest.raises(ValueError, match="whole prompt"):
        margins(lm64, full, prompt, encoded)
    stale = EncodedSample(**{**encoded.__dict__, "candidate_ids": encoded.candidate_ids[:1]})
    cache = kvsieve.observe_prefill(lm64, encoded.context_ids).cache
    with pytest.raises(ValueError, match="do not match"):
        margins(lm64, cache, prompt, stale)
    # without a tokenizer, the rival token is named by its id
    [bare] = margins(lm64, cache, prompt, encode(make_sample("apple", False), tok))
    assert bare.rival.startswith("<id ") and bare.margin == bare.gold_logprob - bare.rival_logprob
