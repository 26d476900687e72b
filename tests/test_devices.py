"""Every command that runs a model takes `--device` and `--dtype`: checked before the model loads, and really used."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kvsieve.harness.cli import app
from kvsieve.harness.report.html import MANIFEST_FILE

runner = CliRunner(env={"COLUMNS": "200"})  # rich must not wrap an error message inside its box

COMMANDS = [
    ["ppl"],
    ["ppl", "--stream", "--max-tokens", "64"],
    ["sweep"],
    ["diagnose"],
    ["map"],
    ["allocation"],
    ["train-gates", "--out", "unused"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--device", "gpu0"], "unknown device 'gpu0'"),
        (["--dtype", "int8"], "unknown dtype 'int8'"),
        (["--dtype", "long"], "unknown dtype 'long'"),
    ],
)
def test_a_bad_device_or_dtype_is_refused_before_the_model_loads(command, option, message):
    result = runner.invoke(app, [*command, "--model", "no/such/model", *option])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_is_refused_where_torch_sees_no_gpu():
    result = runner.invoke(app, ["sweep", "--model", "no/such/model", "--device", "cuda"])
    assert result.exit_code == 2 and "sees no CUDA GPU" in " ".join(result.output.split())


def _ppl(model_dir, out, dtype: str) -> dict:
    args = ["ppl", "--model", str(model_dir), "--docs", "2", "--prefix", "64", "--continuation", "32"]
    args += ["--policies", "snapkv", "--rates", "0.5", "--dtype", dtype, "--json", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_ppl_in_bfloat16_runs_the_model_in_bfloat16(model_dir, tmp_path):
    full = _ppl(model_dir, tmp_path / "float32.json", "float32")
    half = _ppl(model_dir, tmp_path / "bfloat16.json", "bfloat16")
    assert half["full_ppl"] != full["full_ppl"], "the dtype changed nothing: the model did not run in bfloat16"
    assert half["full_ppl"] == pytest.approx(full["full_ppl"], rel=0.05)
    assert half["full_kv_bytes"] * 2 == full["full_kv_bytes"]


def test_sweep_records_device_and_dtype(model_dir, tmp_path):
    out = tmp_path / "sweep"
    args = ["sweep", "--model", str(model_dir), "--tasks", "base", "--policies", "snapkv", "--rates", "0.5"]
    args += ["--samples", "1", "--length", "256", "--out", str(out), "--no-maps", "--dtype", "bfloat16"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["device"] == "cpu" and manifest["dtype"] == "bfloat16"
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    full = next(r for r in rows if r["policy"] == "full")
    # bfloat16: 2 bytes per number; per token 3 layers x 2 kv-heads x 16 dims x (key, value)
    assert full["kv_bytes_full"] == full["context_tokens"] * 3 * 2 * 16 * 2 * 2


def test_kv_bits_store_every_kvsieve_policy_quantized(model_dir, tmp_path):
    out = tmp_path / "ppl.json"
    args = ["ppl", "--model", str(model_dir), "--docs", "2", "--prefix", "64", "--continuation", "32"]
    result = runner.invoke(
        app, [*args, "--policies", "snapkv,random", "--rates", "0.5", "--kv-bits", "4", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [row["policy"] for row in report["rows"]] == ["snapkv:kv_bits=4", "random:kv_bits=4"]
    entry = 2 * (16 * 4 // 8 + 2 * 1 * 4)  # head dimension 16 is one group: codes, a scale and a minimum (float32)
    kept = 33 + 15  # per head: 1 sink and 32 recent, and half of the other 31 (rounded down)
    per_head = (kept - 32) * entry + 32 * 2 * 16 * 4  # the newest 32 in float32 (the residual)
    assert report["rows"][0]["kv_bytes"] == 3 * 2 * per_head
    bad = runner.invoke(app, [*args, "--kv-bits", "3"])
    assert bad.exit_code == 2 and "kv_bits=3 is not supported" in " ".join(bad.output.split())
