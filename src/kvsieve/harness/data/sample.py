"""A task sample (context, question, expected answers, evidence) and its tokenization.

Every generator (RULER-style tasks, the routing probe suite) returns `TaskSample`s in text
with the evidence marked as character spans of the context; `encode` turns one into token
ids with the evidence as token positions, using the model's own tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

#: What a model says when it does not know; a correct answer for samples with `abstain_ok`.
ABSTAIN_ANSWER = "I don't know"


@dataclass(frozen=True)
class TaskSample:
    """One question about a context.

    Attributes:
        task: the task's name, e.g. ``"niah_single_1"`` or ``"hops"``.
        suite: ``"ruler"``, ``"routing"`` or ``"unseen"`` (needle formats the gates never saw).
        index: the sample's number within its task (with the seed, it fixes the sample).
        context: the text that is compressed (question-agnostic: before the question is seen).
        question: what is asked about the context (an instruction or a question).
        answers: every one of these must appear in the output (case-insensitive) to score 100.
        gold: the gold answer as it follows `answer_prefix` (usually starting with a space);
            teacher-forced after the prompt for its log-probability and rank.
        candidates: competing answers (the values of distractors, e.g. other needles' values), written
            exactly as `gold` is (as they follow `answer_prefix`, usually with a leading space); never
            the gold itself. Empty where a task has no distractor with a value of the asked kind.
        evidence: `(start, end)` character spans of `context` the answer depends on.
        answer_prefix: the start of the answer, written after the question (RULER-style), e.g.
            ``"The special magic number for apple is:"``.
        abstain_ok: "I don't know" is the right answer (the context does not say).
        max_new_tokens: how many tokens to generate for the answer.
        meta: anything else the generator records (haystack, depth, hop count, ...).
    """

    task: str
    suite: str
    index: int
    context: str
    question: str
    answers: tuple[str, ...]
    gold: str
    candidates: tuple[str, ...] = ()
    evidence: tuple[tuple[int, int], ...] = ()
    answer_prefix: str = ""
    abstain_ok: bool = False
    max_new_tokens: int = 32
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for start, end in self.evidence:
            if not 0 <= start < end <= len(self.context):
                raise ValueError(f"{self.task}#{self.index}: evidence span {(start, end)} is outside the context")
        if not self.answers:
            raise ValueError(f"{self.task}#{self.index}: a sample needs at least one expected answer")
        if self.gold in self.candidates or "" in self.candidates or len(set(self.candidates)) < len(self.candidates):
            raise ValueError(f"{self.task}#{self.index}: candidates must be distinct, non-empty and not the gold")


@dataclass(frozen=True)
class EncodedSample:
    """A `TaskSample` in token ids of one tokenizer.

    Attributes:
        context_ids: `[1, n]`, with the tokenizer's BOS token when it adds one.
        question_ids: `[1, q]`, no special tokens.
        gold_ids: `[1, g]`, no special tokens.
        gold_content_index: the first gold token that is not whitespace (the one whose rank is reported).
        evidence_positions: sorted token positions in the context that overlap an evidence span.
        candidate_ids: one `[1, c]` per `sample.candidates`, tokenized as `gold_ids` is.
        evidence_spans: per merged evidence character span (`merge_spans`, in order), the half-open range
            `(start, end)` of the context tokens overlapping it (`char_spans_to_token_ranges`); their
            union is `evidence_positions` (neighbouring ranges may share a token that straddles a gap).
    """

    sample: TaskSample
    context_ids: torch.Tensor
    question_ids: torch.Tensor
    gold_ids: torch.Tensor
    evidence_positions: torch.Tensor
    gold_content_index: int = 0
    candidate_ids: tuple[torch.Tensor, ...] = ()
    evidence_spans: tuple[tuple[int, int], ...] = ()

    @property
    def context_length(self) -> int:
        return int(self.context_ids.shape[1])

    def to(self, device: torch.device | str) -> EncodedSample:
        """The same sample with its token ids on `device` (the model's); evidence positions stay on the CPU,
        where the routing diagnostics read them."""
        return replace(
            self,
            context_ids=self.context_ids.to(device),
            question_ids=self.question_ids.to(device),
            gold_ids=self.gold_ids.to(device),
            candidate_ids=tuple(ids.to(device) for ids in self.candidate_ids),
        )


def merge_spans(spans: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """Sorted, disjoint spans covering the same characters."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def char_spans_to_tokens(offsets: list[tuple[int, int]], spans: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Token indices whose character offsets overlap any of `spans` (special tokens have empty offsets)."""
    merged = merge_spans(spans)
    if not merged or not offsets:
        return torch.empty(0, dtype=torch.long)
    starts = torch.tensor([s for s, _ in merged])
    ends = torch.tensor([e for _, e in merged])
    tok = torch.tensor(offsets, dtype=torch.long).reshape(-1, 2)
    # the last span starting before a token ends is the only candidate (spans are disjoint and sorted)
    last = torch.searchsorted(starts, tok[:, 1].contiguous(), side="left") - 1
    hit = (last >= 0) & (ends[last.clamp(min=0)] > tok[:, 0]) & (tok[:, 1] > tok[:, 0])
    return hit.nonzero().flatten()


def char_spans_to_token_ranges(
    offsets: list[tuple[int, int]], spans: tuple[tuple[int, int], ...]
) -> tuple[tuple[int, int], ...]:
    """Per merged span of `spans` (in order), `(first, last + 1)` of the tokens whose offsets overlap it.

    Spans that no token overlaps are left out; a token straddling two neighbouring spans lies in both
    ranges. Offsets are those of one tokenized text (non-decreasing; special tokens are empty).
    """
    merged = merge_spans(spans)
    tok = torch.tensor(offsets, dtype=torch.long).reshape(-1, 2)
    real = (tok[:, 1] > tok[:, 0]).nonzero().flatten()
    if not merged or real.numel() == 0:
        return ()
    # the first real token ending after a span starts, and the first starting at or after it ends
    first = torch.searchsorted(tok[real, 1].contiguous(), torch.tensor([s for s, _ in merged]), side="right")
    after = torch.searchsorted(tok[real, 0].contiguous(), torch.tensor([e for _, e in merged]), side="left")
    pairs = zip(first.tolist(), after.tolist(), strict=True)
    return tuple((int(real[a]), int(real[b - 1]) + 1) for a, b in pairs if a < b)


#: Marks where the user's text goes when a chat template is rendered.
_SLOT = "\x00kvsieve-slot\x00"


def prompt_texts(sample: TaskSample, tokenizer: PreTrainedTokenizerBase, chat: bool | None = None) -> tuple[str, str]:
    """The sample as (context text, question text): their concatenation is the whole prompt.

    With a chat template (`chat=None` uses one when the tokenizer has it), context and question
    form the user's message and the answer prefix starts the assistant's turn; the template's
    own opening (system prompt, role markers) belongs to the context text.
    """
    query = f"\n\n{sample.question}"
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    if not chat:
        return sample.context, f"{query}\n{sample.answer_prefix}".rstrip("\n")
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": _SLOT}], tokenize=False, add_generation_prompt=True
    )
    opening, _, closing = rendered.partition(_SLOT)
    return opening + sample.context, f"{query}{closing}{sample.answer_prefix}"


def encode(sample: TaskSample, tokenizer: PreTrainedTokenizerBase, chat: bool | None = None) -> EncodedSample:
    """Tokenize a sample with the model's tokenizer (a fast one: evidence positions need character offsets).

    See `prompt_texts` for `chat`. Context and question are tokenized separately, so the
    context's ids do not depend on the question.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer; evidence positions need offsets")
    context_text, question_text = prompt_texts(sample, tokenizer, chat)
    shift = len(context_text) - len(sample.context)
    templated = shift > 0  # the template text carries its own BOS / role markers
    context = tokenizer(context_text, return_offsets_mapping=True, add_special_tokens=not templated)
    question = tokenizer(question_text, add_special_tokens=False).input_ids
    gold = tokenizer(sample.gold, add_special_tokens=False).input_ids
    if not question or not gold:
        raise ValueError(f"{sample.task}#{sample.index}: the question and the gold answer must not be empty")
    candidates = [tokenizer(c, add_special_tokens=False).input_ids for c in sample.candidates]
    if not all(candidates):
        raise ValueError(f"{sample.task}#{sample.index}: a candidate answer tokenizes to nothing")
    spans = tuple((start + shift, end + shift) for start, end in sample.evidence)
    return EncodedSample(
        sample=sample,
        context_ids=torch.tensor([context.input_ids], dtype=torch.long),
        question_ids=torch.tensor([question], dtype=torch.long),
        gold_ids=torch.tensor([gold], dtype=torch.long),
        evidence_positions=char_spans_to_tokens(context.offset_mapping, spans),
        gold_content_index=next((i for i, t in enumerate(gold) if tokenizer.decode([t]).strip()), 0),
        candidate_ids=tuple(torch.tensor([ids], dtype=torch.long) for ids in candidates),
        evidence_spans=char_spans_to_token_ranges(context.offset_mapping, spans),
    )


def prompt_tokens(sample: TaskSample, tokenizer: PreTrainedTokenizerBase, chat: bool | None = None) -> int:
    """Tokens of the whole prompt (context + question) as `encode` produces it (for sizing samples).

    Evidence and candidates do not change the ids; they are dropped only to skip mapping spans to
    tokens and tokenizing the candidates.
    """
    encoded = encode(replace(sample, evidence=(), candidates=()), tokenizer, chat)
    return encoded.context_length + int(encoded.question_ids.shape[1])


def token_count(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    """Tokens of `text` without special tokens (for sizing generated contexts)."""
    return len(tokenizer(text, add_special_tokens=False).input_ids)
