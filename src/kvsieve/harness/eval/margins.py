"""Margins of the gold answer over its best competitor, from a (compressed, possibly multi-row) cache.

The margin of a case under a cache (the fixed-contract diagnostic, arXiv 2605.08234) is the gold
answer's log-probability minus the best competing candidate's. Where the sample names competing
answers (`TaskSample.candidates`, the distractors' values) both are teacher-forced sums over the
whole answer; where it names none, the margin is taken at the gold's first content token against
the best other token of the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Cache, PreTrainedTokenizerBase

from ..data.sample import EncodedSample
from .respond import feed, fork, rows_of

CANDIDATES = "candidates"
FIRST_TOKEN = "first_token"


@dataclass(frozen=True)
class Margin:
    """The gold answer against its best competitor, for one row of a cache.

    Attributes:
        gold_logprob: sum of the log-probabilities of the gold answer's tokens (`candidates` kind), or
            of the gold's first content token (`first_token` kind), teacher-forced after the prompt.
        rival: the best competing candidate (its text), or the decoded best token other than the gold's.
        rival_logprob: the rival's log-probability, measured as the gold's is.
        kind: ``"candidates"`` or ``"first_token"``.
    """

    gold_logprob: float
    rival: str
    rival_logprob: float
    kind: str

    @property
    def margin(self) -> float:
        """Gold log-probability minus the rival's: positive when the gold wins."""
        return self.gold_logprob - self.rival_logprob


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1)


def _advance(model: torch.nn.Module, cache: Cache, ids: torch.Tensor, max_feed: int | None) -> torch.Tensor:
    """Feed `ids` (`[rows, n]`, n >= 1) into `cache`, at most `max_feed` a forward; the last logits, `[rows, vocab]`.

    Only one chunk's logits are held at a time, so a long tail costs no `[n, vocab]` tensor.
    """
    step = max_feed or ids.shape[1]
    for start in range(0, ids.shape[1], step):
        logits = feed(model, cache, ids[:, start : start + step])
    return logits[:, -1]


def _answer_logprob(
    model: torch.nn.Module, state: Cache, first: torch.Tensor, answer: torch.Tensor, max_feed: int | None, own: bool
) -> torch.Tensor:
    """Teacher-forced sum log-probability (`[rows]`) of `answer` (`[1, a]`) after `state`.

    `first` (`[rows, vocab]`) are the logits `state` predicts next. `state` is fed only when `own`
    (a copy otherwise), and only for answers of more than one token.
    """
    answer = answer.to(first.device)
    rows = first.shape[0]
    total = _log_probs(first)[:, int(answer[0, 0])]
    if answer.shape[1] > 1:
        logits = feed(model, state if own else fork(state), answer[:, :-1].expand(rows, -1), max_feed)
        later = answer[:, 1:].expand(rows, -1)
        total = total + _log_probs(logits).gather(-1, later[..., None]).squeeze(-1).sum(-1)
    return total


def _by_candidates(
    model: torch.nn.Module, state: Cache, first: torch.Tensor, encoded: EncodedSample, max_feed: int | None
) -> list[Margin]:
    """The gold answer against the best of the sample's candidates, each a teacher-forced sum."""
    answers = [encoded.gold_ids, *encoded.candidate_ids]
    scores = torch.stack(
        [
            _answer_logprob(model, state, first, answer, max_feed, own=i == len(answers) - 1)
            for i, answer in enumerate(answers)
        ],
        dim=1,
    ).cpu()  # [rows, 1 + candidates]
    best = scores[:, 1:].argmax(dim=1)
    names = encoded.sample.candidates
    return [
        Margin(float(row[0]), names[int(b)], float(row[1 + int(b)]), CANDIDATES)
        for row, b in zip(scores, best, strict=True)
    ]


def _by_first_token(
    model: torch.nn.Module,
    state: Cache,
    first: torch.Tensor,
    encoded: EncodedSample,
    max_feed: int | None,
    tokenizer: PreTrainedTokenizerBase | None,
) -> list[Margin]:
    """The gold's first content token against the best other token, the gold's tokens before it teacher-forced."""
    index = encoded.gold_content_index
    gold = encoded.gold_ids.to(first.device)
    logits = first if index == 0 else _advance(model, state, gold[:, :index].expand(first.shape[0], -1), max_feed)
    log_probs = _log_probs(logits).cpu()
    token = int(gold[0, index])
    gold_logprob = log_probs[:, token].clone()
    log_probs[:, token] = float("-inf")
    rival_logprob, rival = log_probs.max(dim=-1)
    names = [tokenizer.decode([int(t)]) if tokenizer is not None else f"<id {int(t)}>" for t in rival]
    return [
        Margin(float(g), name, float(r), FIRST_TOKEN)
        for g, name, r in zip(gold_logprob, names, rival_logprob, strict=True)
    ]


@torch.no_grad()
def margins(
    model: torch.nn.Module,
    cache: Cache,
    prompt_ids: torch.Tensor,
    encoded: EncodedSample,
    max_feed: int | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> list[Margin]:
    """The gold answer's margin over its best competitor, one `Margin` per row of `cache`.

    With candidates (`encoded.candidate_ids`), every answer is teacher-forced from the same state
    after the whole prompt; without, the margin is at the gold's first content token
    (`encoded.gold_content_index`). The cache is left as it is (the work is done on copies); as for
    `respond`, a compressed `SievedCache` needs the model on `kvsieve.sieve_attention`.

    Args:
        cache: holds a prefix of `prompt_ids` (its logical length) in each of its rows; the rest is fed.
        prompt_ids: `[1, n]` the whole prompt (context and question).
        max_feed: feed at most this many tokens a forward (exact either way).
        tokenizer: decodes the rival token of the `first_token` kind (without it: ``"<id 123>"``).
    """
    if len(encoded.candidate_ids) != len(encoded.sample.candidates):
        raise ValueError("encoded.candidate_ids do not match the sample's candidates; encode the sample again")
    rows = rows_of(cache)
    seen = cache.get_seq_length()
    tail = prompt_ids.expand(rows, -1)[:, seen:]
    if tail.shape[1] == 0:
        raise ValueError("the cache already holds the whole prompt; leave at least one prompt token to feed")
    state = fork(cache)
    first = _advance(model, state, tail, max_feed)
    if encoded.candidate_ids:
        return _by_candidates(model, state, first, encoded, max_feed)
    return _by_first_token(model, state, first, encoded, max_feed, tokenizer)
