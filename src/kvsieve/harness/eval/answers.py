"""Scoring one answer: RULER string match, abstention vs hallucination, the gold answer's log-probability and rank."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..data.sample import TaskSample

#: Phrases that mark an answer as an abstention ("I don't know" and its usual variants).
_ABSTENTION = re.compile(
    r"\b(i\s+(do\s+not|don'?t|cannot|can'?t)\s+(know|say|tell|determine|find)|unknown|not\s+(mentioned|stated|"
    r"specified|given|provided)|no\s+(information|mention)|(does|do)\s+not\s+(say|mention|specify)|"
    r"doesn'?t\s+(say|mention|specify)|cannot\s+be\s+determined)\b",
    re.IGNORECASE,
)


def string_match(output: str, answers: tuple[str, ...]) -> float:
    """RULER's `string_match_all`: 100 x the share of expected strings found in `output` (case-insensitive)."""
    text = output.lower()
    return 100.0 * sum(answer.lower() in text for answer in answers) / len(answers)


def is_abstention(output: str) -> bool:
    """The answer declines ("I don't know", "not mentioned", ...) or says nothing."""
    return not output.strip() or _ABSTENTION.search(output) is not None


@dataclass(frozen=True)
class Verdict:
    """How one answer scored.

    Attributes:
        score: 0-100, the share of expected strings found (abstain samples: 100 for an abstention).
        correct: every expected string found (abstain samples: the model abstained).
        abstained: the answer declines to answer.
        hallucinated: a wrong answer that does not abstain (a confident wrong fact).
    """

    score: float
    correct: bool
    abstained: bool
    hallucinated: bool


def judge(output: str, sample: TaskSample) -> Verdict:
    """Score `output` against the sample; wrong answers are abstentions or hallucinations."""
    abstained = is_abstention(output)
    score = (100.0 if abstained else 0.0) if sample.abstain_ok else string_match(output, sample.answers)
    correct = score == 100.0
    return Verdict(score=score, correct=correct, abstained=abstained, hallucinated=not correct and not abstained)


def gold_statistics(logits: torch.Tensor, gold_ids: torch.Tensor, rank_index: int = 0) -> tuple[float, int]:
    """Log-probability of the gold answer and the rank of one of its tokens (1 = the model's top choice).

    Args:
        logits: `[g, vocab]` the logits that predict each gold token (teacher-forced).
        gold_ids: `[g]` the gold token ids.
        rank_index: which gold token to rank; the first one that carries content (a leading
            space token is nearly always the top choice and says nothing).
    """
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    logprob = float(log_probs.gather(-1, gold_ids[:, None]).sum())
    row = logits[rank_index].double()
    rank = 1 + int((row > row[gold_ids[rank_index]]).sum())
    return logprob, rank
