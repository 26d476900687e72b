"""Task samples: validation, tokenization with evidence positions, plain and chat prompts."""

from __future__ import annotations

import random

import pytest

from kvsieve.harness.data.sample import (
    TaskSample,
    char_spans_to_token_ranges,
    char_spans_to_tokens,
    encode,
    merge_spans,
    prompt_texts,
)
from tokenizer import tiny_tokenizer


def sample(**overrides) -> TaskSample:
    context = "Filler. The special magic number for apple is: 1234567. More filler."
    start = context.index("The special")
    fields = dict(
        task="toy",
        suite="ruler",
        index=0,
        context=context,
        question="What is the special magic number for apple?",
        answer_prefix="The special magic number for apple is:",
        answers=("1234567",),
        gold=" 1234567",
        evidence=((start, context.index(" More")),),
    )
    return TaskSample(**(fields | overrides))


def test_char_spans_to_tokens_against_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        offsets, pos = [], 0
        for _ in range(rng.randint(0, 40)):
            if rng.random() < 0.1:
                offsets.append((0, 0))  # a special token
                continue
            width = rng.randint(1, 4)
            offsets.append((pos, pos + width))
            pos += width + rng.randint(0, 1)
        spans = tuple(
            (a, a + rng.randint(1, 6)) for a in (rng.randint(0, max(1, pos)) for _ in range(rng.randint(0, 5)))
        )
        brute = [i for i, (ts, te) in enumerate(offsets) if te > ts and any(ts < e and s < te for s, e in spans)]
        assert char_spans_to_tokens(offsets, spans).tolist() == brute
        ranges = []
        for s, e in merge_spans(spans):
            hits = [i for i, (ts, te) in enumerate(offsets) if te > ts and ts < e and s < te]
            ranges += [(hits[0], hits[-1] + 1)] if hits else []
        assert char_spans_to_token_ranges(offsets, spans) == tuple(ranges)
    assert merge_spans(((5, 9), (0, 3), (2, 4), (9, 10))) == [(0, 4), (5, 10)]


def test_encode_plain_evidence_decodes_to_the_needle():
    tok = tiny_tokenizer()
    s = sample()
    encoded = encode(s, tok)
    assert encoded.context_ids[0, 0] == tok.bos_token_id
    assert tok.decode(encoded.context_ids[0], skip_special_tokens=True) == s.context
    evidence = tok.decode(encoded.context_ids[0, encoded.evidence_positions])
    assert "The special magic number for apple is: 1234567." in evidence
    assert len(evidence) <= len("The special magic number for apple is: 1234567.") + 2  # token boundary slack
    question = tok.decode(encoded.question_ids[0])
    assert question == f"\n\n{s.question}\n{s.answer_prefix}"
    content = encoded.gold_content_index
    assert tok.decode(encoded.gold_ids[0, content]).strip()  # the ranked token carries content
    assert all(not tok.decode(t).strip() for t in encoded.gold_ids[0, :content])  # only whitespace before it


def test_encode_chat_template_shifts_evidence():
    tok = tiny_tokenizer()
    tok_chat = tiny_tokenizer().__class__(tokenizer_object=tok.backend_tokenizer, bos_token="<s>", eos_token="</s>")
    tok_chat.chat_template = "<s>[user] {{ messages[0]['content'] }} [assistant] "
    s = sample()
    context_text, question_text = prompt_texts(s, tok_chat)
    assert context_text == "<s>[user] " + s.context
    assert question_text == f"\n\n{s.question} [assistant] {s.answer_prefix}"
    encoded = encode(s, tok_chat)
    assert (encoded.context_ids[0] == tok.bos_token_id).sum() == 1  # the template's BOS, not a second one
    assert "1234567" in tok.decode(encoded.context_ids[0, encoded.evidence_positions])
    [(start, end)] = encoded.evidence_spans  # shifted by the template's opening, as the positions are
    assert list(range(start, end)) == encoded.evidence_positions.tolist()
    assert prompt_texts(s, tok_chat, chat=False) == prompt_texts(s, tok)


def test_candidates_are_encoded_like_the_gold():
    tok = tiny_tokenizer()
    s = sample(candidates=(" 7654321", " apple"))
    encoded = encode(s, tok)
    assert len(encoded.candidate_ids) == 2
    for text, ids in zip(s.candidates, encoded.candidate_ids, strict=True):
        assert ids.shape == (1, len(tok(text, add_special_tokens=False).input_ids))
        assert tok.decode(ids[0]) == text
    assert encode(sample(), tok).candidate_ids == ()
    # the same context: spans and positions do not depend on the candidates
    assert encoded.evidence_spans == encode(sample(), tok).evidence_spans


def test_bad_samples_are_refused():
    with pytest.raises(ValueError, match="outside the context"):
        sample(evidence=((0, 10_000),))
    with pytest.raises(ValueError, match="at least one expected answer"):
        sample(answers=())
    for candidates in ((" 1234567",), ("",), (" 1", " 1")):
        with pytest.raises(ValueError, match="candidates must be distinct"):
            sample(candidates=candidates)
