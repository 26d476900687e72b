"""`kvsieve sweep`, `kvsieve report` and `kvsieve map` end to end on a tiny model saved to disk."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from extras import needs
from kvsieve.harness.cli import app

runner = CliRunner(env={"COLUMNS": "200"})  # rich must not wrap an error message inside its box


def sweep_args(model_dir, out, samples="2") -> list[str]:
    return [
        "sweep",
        "--model",
        str(model_dir),
        "--tasks",
        "niah_single_1,base",
        "--policies",
        "snapkv,random",
        "--rates",
        "0.5,0.9",
        "--samples",
        samples,
        "--length",
        "512",
        "--modes",
        "agnostic,aware",
        "--out",
        str(out),
    ]


def test_sweep_report_and_resume(model_dir, tmp_path):
    out = tmp_path / "sweep"
    result = runner.invoke(app, sweep_args(model_dir, out, samples="1"))
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    # 2 tasks x 1 sample x 2 modes x (full + 2 policies x 2 rates)
    assert len(rows) == 2 * 2 * 5
    assert {r["task"] for r in rows} == {"niah_single_1", "base"} and {r["mode"] for r in rows} == {"agnostic", "aware"}
    assert "Accuracy (%) by rate" in result.output
    maps = sorted(p.name for p in (out / "maps").glob("*.png"))
    assert len(maps) == 2 * 2  # each task's first sample, each policy, at the top rate

    # a second sample per task: only the new sample's rows run
    again = runner.invoke(app, sweep_args(model_dir, out, samples="2"))
    assert again.exit_code == 0, again.output
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 2 * 5
    assert len({(r["sample"], r["mode"], r["policy"], r["rate"]) for r in rows}) == len(rows)

    report = runner.invoke(app, ["report", str(out)])
    assert report.exit_code == 0, report.output
    page = (out / "report.html").read_text()
    for heading in ("Accuracy (%) by rate", "The cliff", "Hallucination vs Global Eviction Ratio", "Eviction maps"):
        assert heading in page
    assert page.count("data:image/png;base64") >= 3 + len(maps)


def test_map_command(model_dir, tmp_path):
    path = tmp_path / "map.png"
    args = ["map", "--model", str(model_dir), "--task", "hops", "--length", "512", "--rate", "0.8", "--out", str(path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tasks", "nonsense"], "unknown task 'nonsense'"),
        (["--policies", "nonsense"], "unknown policy 'nonsense'"),
        (["--rates", "1.5"], "[0, 1)"),
        (["--modes", "sideways"], "modes are agnostic, aware"),
        (["--policies", "kvzip:chunk=512,kvzip"], "cannot share one prefill"),
    ],
)
def test_sweep_bad_input(args, message, tmp_path):
    result = runner.invoke(app, ["sweep", "--out", str(tmp_path), *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_report_without_results(tmp_path):
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2
    assert "holds no sweep rows" in " ".join(result.output.split())


def test_diagnose_writes_the_page_and_report_renders_it(model_dir, tmp_path):
    out = tmp_path / "diagnostic"
    args = ["diagnose", "--model", str(model_dir), "--tasks", "hops,niah_multikey_1", "--scalars", "snapkv,vatp"]
    args += ["--rates", "0.9", "--samples", "1", "--length", "512", "--modes", "agnostic", "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "diagnostic.jsonl").read_text().splitlines()]
    assert {r["policy"] for r in rows} >= {"full", "importance", "snapkv", "vatp", "caote:projection=chunk"}
    page = (out / "diagnostic.md").read_text()
    for heading in ("raise the margin over attention mass", "Failure modes", "The fixes", "A worked case"):
        assert heading in page
    (out / "diagnostic.md").unlink()
    again = runner.invoke(app, ["report", str(out)])
    assert again.exit_code == 0, again.output
    assert (out / "diagnostic.md").read_text() == page


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scalars", "nonsense"], "unknown policy 'nonsense'"),
        (["--contract", "sideways"], "unknown allocator"),
    ],
)
def test_diagnose_bad_input(args, message, tmp_path):
    result = runner.invoke(app, ["diagnose", "--out", str(tmp_path), *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--cpus-per-worker", "2"], "only applies with --ray or --workers"),
        pytest.param(["--ray", "auto"], "cannot reach a Ray cluster at 'auto'", marks=needs("ray", "ray")),
        pytest.param(
            ["--workers", "64", "--cpus-per-worker", "64"], "64 workers x 64 CPUs need 4096", marks=needs("ray", "ray")
        ),
    ],
)
def test_ray_options_errors(model_dir, tmp_path, options, message, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args = ["sweep", "--model", str(model_dir), "--tasks", "niah_single_1", "--out", str(tmp_path), *options]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and message in result.output, result.output


def test_without_ray_installed_the_options_say_how_to_get_it(model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    monkeypatch.delitem(sys.modules, "kvsieve.harness.runners.ray_runner", raising=False)
    args = ["ppl", "--model", str(model_dir), "--docs", "1", "--workers", "2"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and 'pip install -e ".[ray]" in the checkout' in " ".join(result.output.split())
