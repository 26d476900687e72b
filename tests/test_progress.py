"""Progress where the output is a log: plain lines at intervals, the last one when the work is done."""

from __future__ import annotations

import io

from rich.console import Console

from kvsieve.harness import progress
from kvsieve.harness.progress import ProgressLines, progress_bar


def test_a_log_gets_a_line_per_interval_and_one_at_the_end(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(progress, "console", Console(file=out, width=40))  # a line is never wrapped
    now = [0.0]
    lines = ProgressLines("streaming, 8 bits", every=60, clock=lambda: now[0])
    for step, at in enumerate((10, 30, 70, 100, 135, 150), start=1):
        now[0] = at
        lines(step, 10 if step < 6 else 6)
    printed = out.getvalue().splitlines()
    assert printed == [
        "streaming, 8 bits: 3/10, 0:01:10 elapsed, about 0:02:43 left",
        "streaming, 8 bits: 5/10, 0:02:15 elapsed, about 0:02:15 left",
        "streaming, 8 bits: 6/6, 0:02:30 elapsed",
    ]


def test_the_bar_prints_lines_when_the_console_is_not_a_terminal(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(progress, "console", Console(file=out, width=200))
    with progress_bar("training") as advance:
        advance(1, 2)
        advance(2, 2)
    assert out.getvalue().splitlines()[-1].startswith("training: 2/2, 0:00:00 elapsed")
    with progress_bar("hidden", visible=False) as advance:
        advance(2, 2)
    assert "hidden" not in out.getvalue()
