"""Tables, plots and the command line (no model needed)."""

from __future__ import annotations

from typer.testing import CliRunner

from kvsieve.harness.cli import app
from kvsieve.harness.report import plot_ppl, ppl_markdown
from kvsieve.selection.allocators import ALLOCATORS
from kvsieve.selection.scorers import SCORERS

REPORT = {
    "full_ppl": 10.0,
    "docs": 2,
    "tokens": 100,
    "prefix": 64,
    "continuation": 50,
    "rate_counts": "evicted fraction of evictable entries",
    "rows": [
        {"policy": "importance", "rate": 0.7, "ppl": 11.0, "delta_pct": 10.0, "ci95": [5.0, 15.0], "kv_bytes": 1},
        {"policy": "random", "rate": 0.7, "ppl": 13.0, "delta_pct": 30.0, "ci95": [20.0, 40.0], "kv_bytes": 1},
    ],
}


def test_markdown_table_has_advantage_over_random():
    text = ppl_markdown(REPORT)
    assert "| rate | importance delta% [95% CI] | random delta% [95% CI] | advantage (pp) |" in text
    assert "| 70% | +10.00% [+5.0, +15.0] | +30.00% [+20.0, +40.0] | +20.00 |" in text


def test_plot_writes_png(tmp_path):
    path = plot_ppl(REPORT, tmp_path / "ppl.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_lists_policies():
    result = CliRunner().invoke(app, ["policies"])
    assert result.exit_code == 0
    for name in [*SCORERS, *ALLOCATORS]:
        assert name in result.output
    assert "chunk(chunk_size=8, best_tokens=0.0)" in result.output and "sentence(best_tokens=0.0)" in result.output
    assert "merge=NAME" in result.output and all(
        f"{name}(parts=1)" in result.output for name in ("mean", "window", "output")
    )


def test_by_policy_table_lists_every_policy_with_its_mean_advantage():
    text = ppl_markdown(REPORT, by_policy=True)
    assert "| policy | 70% delta% [95% CI] | KV MiB at last rate | mean advantage (pp) |" in text
    assert "| importance | +10.00% [+5.0, +15.0] | 0.0 | +20.00 |" in text


def test_cli_rejects_unknown_policy_and_bad_rate_before_loading():
    result = CliRunner().invoke(app, ["ppl", "--policies", "importance,nope"])
    assert result.exit_code != 0 and "unknown policy 'nope'" in result.output
    result = CliRunner().invoke(app, ["ppl", "--policies", "snapkv+adaptive:window=8,safeguard=2"])
    assert result.exit_code != 0 and "safeguard must be in [0, 1]" in result.output
    result = CliRunner().invoke(app, ["ppl", "--rates", "0.5,1.2"])
    assert result.exit_code != 0 and "rate must be in [0, 1)" in result.output
