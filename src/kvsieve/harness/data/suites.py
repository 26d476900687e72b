"""Task names -> samples: the RULER-style tasks, the routing probe families and the needles in unseen formats,
by name or by suite."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from .routing import ROUTING_FAMILIES, routing_samples
from .ruler import RULER_SUITES, ruler_samples
from .sample import TaskSample

#: ``unseen``: needle formats no training set of the gates uses (`harness.training.data.training_tasks` refuses
#: them); ``varied``: needle formats for training alone (`train-gates --tasks`); ``procedural``: needles in a format
#: drawn anew for every sample, for training alone.
SUITES: dict[str, tuple[str, ...]] = RULER_SUITES | {"routing": ROUTING_FAMILIES}
TASKS: tuple[str, ...] = tuple(task for tasks in SUITES.values() for task in tasks)


def resolve_tasks(names: str | list[str]) -> list[str]:
    """Expand suite names (``ruler``, ``routing``, ``unseen``) and check task names; order kept, duplicates
    dropped."""
    items = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    tasks: list[str] = []
    for name in filter(None, items):
        if name in SUITES:
            tasks += SUITES[name]
        elif name in TASKS:
            tasks.append(name)
        else:
            known = ", ".join([*SUITES, *TASKS])
            raise ValueError(f"unknown task {name!r}; known: {known}")
    if not tasks:
        raise ValueError("no task given")
    return list(dict.fromkeys(tasks))


def task_samples(
    names: str | list[str],
    tokenizer: PreTrainedTokenizerBase,
    length: int = 2048,
    n: int = 10,
    seed: int = 0,
    chat: bool | None = None,
) -> list[TaskSample]:
    """`n` samples of every named task (suites expand), each prompt about `length` tokens."""
    samples: list[TaskSample] = []
    for task in resolve_tasks(names):
        make = routing_samples if task in ROUTING_FAMILIES else ruler_samples
        samples += make(task, tokenizer, length=length, n=n, seed=seed, chat=chat)
    return samples
