"""Task names -> samples: the RULER-style tasks and the routing probe families, by name or by suite."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from .routing import ROUTING_FAMILIES, routing_samples
from .ruler import RULER_TASKS, ruler_samples
from .sample import TaskSample

SUITES: dict[str, tuple[str, ...]] = {"ruler": RULER_TASKS, "routing": ROUTING_FAMILIES}


def resolve_tasks(names: str | list[str]) -> list[str]:
    """Expand suite names (``ruler``, ``routing``) and check task names; order kept, duplicates dropped."""
    items = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    tasks: list[str] = []
    for name in filter(None, items):
        if name in SUITES:
            tasks += SUITES[name]
        elif name in RULER_TASKS or name in ROUTING_FAMILIES:
            tasks.append(name)
        else:
            known = ", ".join([*SUITES, *RULER_TASKS, *ROUTING_FAMILIES])
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
        make = ruler_samples if task in RULER_TASKS else routing_samples
        samples += make(task, tokenizer, length=length, n=n, seed=seed, chat=chat)
    return samples
