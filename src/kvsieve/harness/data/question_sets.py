"""Several questions about one context, for "compress once, ask many" (a cached document queried again).

A generated sample asks one question; `question_set` asks its context every question the context
answers: each key of a multi-key needle task (one needle each), each person of a routing
``multi_entity`` sample, and each link and each person's attribute of a ``hops`` chain (with the
chain question itself). Every question comes with its own evidence (the statement that answers it)
and competing answers; the context is the same string, so it is compressed once for all of them.
"""

from __future__ import annotations

from dataclasses import replace

from transformers import PreTrainedTokenizerBase

from .routing import RELATIONS, Relation
from .ruler import NIAH_CONFIGS
from .sample import TaskSample
from .suites import task_samples

#: Tasks whose contexts answer several questions (`question_set`).
QUESTION_SET_TASKS: tuple[str, ...] = ("niah_multikey_1", "niah_ledger", "niah_locker", "multi_entity", "hops")


def _span(context: str, statement: str, where: str) -> tuple[int, int]:
    """Where `statement` stands in `context` (it must stand there once)."""
    start = context.find(statement)
    if start < 0 or context.find(statement, start + 1) >= 0:
        raise ValueError(f"{where}: the statement {statement!r} is not in the context exactly once")
    return start, start + len(statement)


def _ask(
    sample: TaskSample,
    statement: str,
    question: str,
    prefix: str,
    answer: str,
    others: list[str],
    meta: dict,
) -> TaskSample:
    """The sample asked `question`, answered by `statement` (`answer`), with `others` as competing answers."""
    where = f"{sample.task}#{sample.index}"
    start, end = _span(sample.context, statement, where)
    candidates = tuple(f" {v}" for v in dict.fromkeys(others) if v != answer)
    return replace(
        sample,
        question=question,
        answer_prefix=prefix,
        answers=(answer,),
        gold=f" {answer}",
        candidates=candidates,
        evidence=((start, end),),
        meta=sample.meta | meta | {"evidence_depths": [round(start / len(sample.context), 4)]},
    )


def _niah_questions(sample: TaskSample) -> list[TaskSample]:
    cfg = NIAH_CONFIGS[sample.task]
    keys, values = sample.meta["keys"], [v[0] for v in sample.meta["values"]]
    out = []
    for key, value in zip(keys, values, strict=True):
        _, question, prefix = cfg.format.asks(True, cfg.value_type, key)
        statement = cfg.format.needle(key, value, cfg.value_type)
        out.append(_ask(sample, statement, question, prefix, value, values, {"queries": [key]}))
    return out


def _relation_question(
    sample: TaskSample, relation: Relation, subject: str, answer: str, others: list[str], meta: dict
) -> TaskSample:
    """The sample asked `relation` of `subject` (a name), answered by the statement that gives `answer`."""
    question, prefix = relation.ask(subject, f"{subject}'s")
    statement = relation.state(subject, f"{subject}'s", answer)
    return _ask(sample, statement, question, prefix, answer, others, {"entity": subject} | meta)


def _entity_questions(sample: TaskSample) -> list[TaskSample]:
    relation = RELATIONS[sample.meta["relation"]]
    names, values = sample.meta["entities"], sample.meta["values"]
    return [_relation_question(sample, relation, n, v, values, {}) for n, v in zip(names, values, strict=True)]


def _hops_questions(sample: TaskSample) -> list[TaskSample]:
    people, values = sample.meta["people"], sample.meta["values"]
    *kinships, end = (RELATIONS[name] for name in sample.meta["chain"])
    links = [
        _relation_question(sample, kinship, person, next_person, people, {"relation": kinship.name, "hops": 1})
        for kinship, person, next_person in zip(kinships, people, people[1:], strict=False)
    ]
    ends = [_relation_question(sample, end, p, v, values, {"hops": 1}) for p, v in zip(people, values, strict=True)]
    return [*links, *ends, sample]


_QUESTIONS = {
    "niah_multikey_1": _niah_questions,
    "niah_ledger": _niah_questions,
    "niah_locker": _niah_questions,
    "multi_entity": _entity_questions,
    "hops": _hops_questions,
}


def question_set(sample: TaskSample) -> list[TaskSample]:
    """Every question `sample`'s context answers (one of `QUESTION_SET_TASKS`), the context unchanged."""
    if sample.task not in _QUESTIONS:
        raise ValueError(
            f"{sample.task}: no question set; tasks whose contexts answer several questions: "
            f"{', '.join(QUESTION_SET_TASKS)}"
        )
    return _QUESTIONS[sample.task](sample)


def question_sets(
    names: str | list[str],
    tokenizer: PreTrainedTokenizerBase,
    length: int = 2048,
    n: int = 10,
    seed: int = 0,
    chat: bool | None = None,
) -> list[list[TaskSample]]:
    """`n` contexts of every named task (`task_samples`), each with every question it answers."""
    return [question_set(sample) for sample in task_samples(names, tokenizer, length, n, seed, chat)]
