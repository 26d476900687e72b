"""Progress for long harness runs: the callback the evaluations take, and the terminal bar that drives it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

#: The terminal the harness prints to (tables, bars).
console = Console()

#: Called as work advances: `(done, total)`, in any unit the caller counts (forwards, configurations, steps).
ProgressCallback = Callable[..., None]

#: Seconds between two progress lines where the output is not a terminal (a log file, a pipe).
LOG_EVERY_S = 60.0


@contextmanager
def progress_bar(
    description: str, *, fields: str = "", visible: bool = True, **initial: float
) -> Iterator[ProgressCallback]:
    """A rich progress bar with an ETA, driven by `(done, total, **values)` callbacks.

    `fields` is a template of extra values shown after the count, e.g. ``"kl {task.fields[kl]:.4f}"``,
    with their `initial` values; each callback may pass new ones. Where the output is not a terminal,
    a bar would print nothing until the end, so a plain line says the count every `LOG_EVERY_S` seconds.
    """
    if visible and not console.is_terminal:
        yield ProgressLines(description)
        return
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
    columns += [TextColumn(fields)] if fields else []
    with Progress(*columns, TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task(description, total=None, visible=visible, **initial)
        yield lambda done, total, **values: bar.update(task, completed=done, total=total, **values)


class ProgressLines:
    """A `ProgressCallback` that prints `description: done/total, elapsed, ETA` at most every `every` seconds
    and when the count reaches its total."""

    def __init__(self, description: str, every: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.description, self.every, self.clock = description, every, clock
        self.start = self.last = clock()

    def __call__(self, done: float, total: float | None, **values: float) -> None:
        now = self.clock()
        finished = total is not None and done >= total
        if now - self.last < self.every and not finished:
            return
        self.last = now
        elapsed = now - self.start
        line = f"{self.description}: {done:g}/{total:g}" if total is not None else f"{self.description}: {done:g}"
        line += f", {_clock(elapsed)} elapsed"
        if total and 0 < done < total:
            line += f", about {_clock(elapsed * (total - done) / done)} left"
        console.print(line, highlight=False, soft_wrap=True)


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))
