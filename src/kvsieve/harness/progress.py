"""Progress for long harness runs: the callback the evaluations take, and the terminal bar that drives it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

#: The terminal the harness prints to (tables, bars).
console = Console()

#: Called as work advances: `(done, total)`, in any unit the caller counts (forwards, configurations, steps).
ProgressCallback = Callable[..., None]


@contextmanager
def progress_bar(
    description: str, *, fields: str = "", visible: bool = True, **initial: float
) -> Iterator[ProgressCallback]:
    """A rich progress bar with an ETA, driven by `(done, total, **values)` callbacks.

    `fields` is a template of extra values shown after the count, e.g. ``"kl {task.fields[kl]:.4f}"``,
    with their `initial` values; each callback may pass new ones.
    """
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
    columns += [TextColumn(fields)] if fields else []
    with Progress(*columns, TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task(description, total=None, visible=visible, **initial)
        yield lambda done, total, **values: bar.update(task, completed=done, total=total, **values)
