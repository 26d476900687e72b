"""The scheduling seam: a `Work` done on cells, and a `Runner` that does it where the model lives."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, TypeVar

import torch

CellT = TypeVar("CellT", contravariant=True)
ResultT = TypeVar("ResultT", covariant=True)
C = TypeVar("C")
R = TypeVar("R")


class Work(Protocol[CellT, ResultT]):
    """What is done with one cell, given a model replica and its tokenizer.

    A runner may send it to another process, so it must pickle by reference: a module-level
    function or an instance of a module-level class (a dataclass of the protocol's settings).
    """

    def __call__(self, model: torch.nn.Module, tokenizer: Any, cell: CellT) -> ResultT: ...


class Runner(Protocol):
    """Runs `work` on cells where a model replica lives."""

    def map(self, work: Work[C, R], cells: Sequence[C]) -> Iterator[R]:
        """`work` on every cell; the results in the cells' order, each once it and every one before it is done."""
        ...


def run_once(runner: Runner, work: Work[C, R], cell: C) -> R:
    """`work` on the one `cell` (a check or a lookup that needs the model, e.g. a preflight)."""
    return next(iter(runner.map(work, [cell])))
