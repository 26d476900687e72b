"""The routing probe suite (arXiv 2603.01426): length, determinism, evidence, and each family's structure.

Structure is checked by reading the generated text back (regular expressions built from the relation
templates), not by trusting the generator's own bookkeeping.
"""

from __future__ import annotations

import re
import string
from functools import cache

import pytest
import torch

import kvsieve
from kvsieve.harness.data.routing import (
    LONG_CONTEXT_DEPTH,
    RELATIONS,
    ROUTING_FAMILIES,
    relation_values,
    routing_samples,
)
from kvsieve.harness.data.sample import ABSTAIN_ANSWER, TaskSample, encode
from tokenizer import tiny_tokenizer

LENGTH, N = 480, 6
NAME = r"[A-Z][a-z]+ [A-Z][a-z]+"
PRONOUNS = {"she": ("She", "Her"), "he": ("He", "His")}


@cache
def samples(family: str, length: int = LENGTH, n: int = N, seed: int = 0) -> tuple[TaskSample, ...]:
    return tuple(routing_samples(family, tiny_tokenizer(), length=length, n=n, seed=seed))


def statement_regex(template: str, subject: str, possessive: str) -> re.Pattern[str]:
    """A template like ``"{subject} lives in {value}."`` as a regex; `subject`/`possessive` are regex text."""
    parts = []
    for literal, name, _, _ in string.Formatter().parse(template):
        parts.append(re.escape(literal))
        if name is not None:
            parts.append({"subject": subject, "possessive": possessive, "value": r"(?P<value>[^.]+?)"}[name])
    return re.compile("".join(parts))


def about(relation: str, name: str) -> re.Pattern[str]:
    return statement_regex(RELATIONS[relation].statement, re.escape(name), re.escape(f"{name}'s"))


def evidence_text(sample: TaskSample) -> str:
    return " ".join(sample.context[a:b] for a, b in sample.evidence)


def prompt_tokens(sample: TaskSample, tokenizer, chat: bool | None = None) -> int:
    encoded = encode(sample, tokenizer, chat)
    return encoded.context_length + encoded.question_ids.shape[1]


def test_family_names_and_errors():
    assert ROUTING_FAMILIES == (
        "base",
        "manipulation",
        "multi_presence",
        "multi_entity",
        "coreference",
        "long_context",
        "hops",
    )
    with pytest.raises(ValueError, match="unknown routing family 'nope'") as err:
        routing_samples("nope", tiny_tokenizer())
    assert all(f in str(err.value) for f in ROUTING_FAMILIES)
    with pytest.raises(ValueError, match="too small"):
        routing_samples("hops", tiny_tokenizer(), length=40, n=1)


def test_deterministic_and_indices_differ():
    again = routing_samples("multi_entity", tiny_tokenizer(), length=LENGTH, n=N, seed=0)
    assert tuple(again) == samples("multi_entity")
    other_seed = routing_samples("multi_entity", tiny_tokenizer(), length=LENGTH, n=N, seed=1)
    assert [s.question for s in other_seed] != [s.question for s in again]
    for family in ROUTING_FAMILIES:
        batch = samples(family)
        assert len({s.question for s in batch}) == N, family  # a new entity / fact per index
        assert len({s.context for s in batch}) == N, family
        assert [s.index for s in batch] == list(range(N))


@pytest.mark.parametrize("family", ROUTING_FAMILIES)
def test_prompt_length_window(family):
    tok = tiny_tokenizer()
    for sample in samples(family):
        assert sample.suite == "routing" and sample.task == family and sample.meta["family"] == family
        assert 0.9 * LENGTH <= prompt_tokens(sample, tok) <= LENGTH


def test_prompt_length_window_other_length():
    tok = tiny_tokenizer()
    for sample in samples("base", length=900, n=3):
        assert 810 <= prompt_tokens(sample, tok) <= 900


@pytest.mark.parametrize("family", ROUTING_FAMILIES)
def test_answers_in_evidence_and_evidence_tokens_decode_to_facts(family):
    tok = tiny_tokenizer()
    for sample in samples(family):
        assert sample.evidence and sample.gold == " " + sample.answers[0]
        if not sample.abstain_ok:
            text = evidence_text(sample).lower()
            assert all(answer.lower() in text for answer in sample.answers)
        encoded = encode(sample, tok, chat=False)
        positions = encoded.evidence_positions
        assert positions.numel() > 0
        # decode each contiguous run of evidence tokens; every evidence sentence must be inside one
        breaks = torch.nonzero(positions.diff() > 1).flatten().tolist()
        runs = torch.tensor_split(positions, [b + 1 for b in breaks])
        decoded = [tok.decode(encoded.context_ids[0, run]) for run in runs]
        for start, end in sample.evidence:
            fact = sample.context[start:end]
            assert fact.endswith(".") and fact[0].isupper()
            assert any(fact in text for text in decoded), (fact, decoded)


def test_depths_spread_and_long_context_early():
    tok = tiny_tokenizer()
    depths = [s.meta["depth"] for f in ("base", "multi_entity", "hops") for s in samples(f)]
    assert min(depths) < 0.35 and max(depths) > 0.65
    low, high = LONG_CONTEXT_DEPTH
    for sample in samples("long_context", length=800):
        encoded = encode(sample, tok, chat=False)
        relative = encoded.evidence_positions.double() / encoded.context_length
        assert low <= relative.min() and relative.max() < high
        assert low <= sample.meta["depth"] < high
        assert len(re.findall(rf"{NAME} (?:works|lives|was born|keeps|plays)|{NAME}'s favourite", sample.context)) == 2


def test_hops_chain_recomputed_from_the_text():
    counts = set()
    for sample in samples("hops", n=8):
        chain = sample.meta["chain"]
        counts.add(len(chain))
        current, used = sample.meta["entity"], []
        for relation in chain:
            matches = list(about(relation, current).finditer(sample.context))
            assert len(matches) == 1, (relation, current)
            used.append(sample.context[matches[0].start() : matches[0].end()])
            current = matches[0]["value"]
        assert current == sample.answers[0]
        assert sorted(used) == sorted(sample.context[a:b] for a, b in sample.evidence)
        # the chain's start has the asked attribute too, with another value: following one hop less is wrong
        own = about(chain[-1], sample.meta["entity"]).search(sample.context)
        assert own is not None and own["value"] != sample.answers[0]
        assert sample.meta["entity"] in sample.question
    assert counts == {2, 3}


def test_coreference_pronouns_and_abstention():
    batch = samples("coreference", n=12)
    abstain = [s for s in batch if s.abstain_ok]
    assert 0 < len(abstain) < len(batch) and len(abstain) == 4
    for sample in batch:
        name, relation = sample.meta["entity"], RELATIONS[sample.meta["relation"]]
        subject, possessive = PRONOUNS[sample.meta["pronoun"]]
        facts = [sample.context[a:b] for a, b in sample.evidence]
        assert name in facts[0] and all(name not in f for f in facts[1:])
        assert all(f.split()[0] in (subject, possessive) for f in facts[1:])
        assert ABSTAIN_ANSWER in sample.question
        by_pronoun = statement_regex(relation.statement, subject, possessive)
        if sample.abstain_ok:
            assert sample.answers == (ABSTAIN_ANSWER,) and sample.gold == " " + ABSTAIN_ANSWER
            # the asked attribute is stated nowhere: not by name, not by pronoun, no value of its kind at all
            assert about(relation.name, name).search(sample.context) is None
            assert by_pronoun.search(sample.context) is None
            values = relation_values(relation.name)
            assert values == () or not re.search(rf"\b({'|'.join(values)})\b", sample.context, re.IGNORECASE)
        else:
            assert len(facts) == 2
            match = by_pronoun.fullmatch(facts[1])
            assert match is not None and match["value"] == sample.answers[0]
            # the other person's facts never repeat the answer: only the pronoun's referent tells them apart
            assert len(re.findall(rf"\b{re.escape(sample.answers[0])}\b", sample.context)) == 1


def test_multi_entity_distractors_share_the_attribute():
    for sample in samples("multi_entity"):
        relation = RELATIONS[sample.meta["relation"]]
        pattern = statement_regex(relation.statement, f"(?P<who>{NAME})", f"(?P<who>{NAME})'s")
        found = {m["who"]: m["value"] for m in pattern.finditer(sample.context)}
        assert len(found) == sample.meta["distractors"] + 1 >= 3
        assert len(set(found.values())) == len(found)  # same attribute type, different values
        assert found[sample.meta["entity"]] == sample.answers[0]


@pytest.mark.parametrize("family", ROUTING_FAMILIES)
def test_candidates_are_the_distractors_values_of_the_asked_relation(family):
    tok = tiny_tokenizer()
    for sample in samples(family):
        encoded = encode(sample, tok, chat=False)
        assert [ids[0].tolist() for ids in encoded.candidate_ids] == [
            tok(c, add_special_tokens=False).input_ids for c in sample.candidates
        ]
        covered = sorted({i for a, b in encoded.evidence_spans for i in range(a, b)})
        assert covered == encoded.evidence_positions.tolist()
        if family not in ("multi_entity", "hops"):
            assert sample.candidates == ()
            continue
        relation = RELATIONS[sample.meta["relation"]]
        pattern = statement_regex(relation.statement, f"(?P<who>{NAME})", f"(?P<who>{NAME})'s")
        stated = [m["value"] for m in pattern.finditer(sample.context)]
        assert sample.candidates and sample.gold not in sample.candidates
        assert all(c.startswith(" ") and c.strip() in sample.context for c in sample.candidates)
        # every other value the asked relation has in the context, once each
        assert sorted(c.strip() for c in sample.candidates) == sorted(v for v in stated if v != sample.answers[0])
        assert len(sample.candidates) == sample.meta["distractors"]


def test_multi_presence_one_mention_holds_the_answer():
    for sample in samples("multi_presence"):
        name = sample.meta["entity"]
        assert sample.context.count(name) == sample.meta["mentions"] >= 3
        asked = about(sample.meta["relation"], name).findall(sample.context)
        assert asked == [sample.answers[0]]
        assert len(sample.evidence) == 1 and name in evidence_text(sample)


def test_manipulation_contradicts_common_knowledge():
    for sample in samples("manipulation"):
        fact = evidence_text(sample)
        assert fact.startswith("In this world, ") and sample.meta["subject"] in fact
        assert sample.answers[0] != sample.meta["common_answer"]
        assert sample.meta["common_answer"].lower() not in fact.lower()
        assert sample.answer_prefix.startswith("In this world")


@pytest.mark.integration
def test_default_model_chat_prompt_lengths():
    _, tokenizer = kvsieve.load_model()
    assert tokenizer.chat_template
    for family in ROUTING_FAMILIES:
        for sample in routing_samples(family, tokenizer, length=600, n=2, seed=3):
            assert 540 <= prompt_tokens(sample, tokenizer) <= 600  # chat=None: the template counts
            encoded = encode(sample, tokenizer)
            decoded = tokenizer.decode(encoded.context_ids[0, encoded.evidence_positions])
            assert sample.context[slice(*sample.evidence[-1])] in decoded
