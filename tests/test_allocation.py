"""Where the budget goes: the allocation of a global allocator beside the uniform split, its figure and command."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import kvsieve
from conftest import tiny_gemma3, tiny_llama
from kvsieve.harness.cli import app
from kvsieve.harness.eval.allocation import budget_allocation
from kvsieve.harness.report.figures import plot_allocation

POLICY = "trimkv+global:gates=untrained"


def _ids(tokens: int = 96) -> torch.Tensor:
    return torch.randint(1, 128, (1, tokens), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("make_model", [tiny_llama, tiny_gemma3])
def test_allocation_is_what_the_caches_keep(make_model, tmp_path):
    model, ids = make_model(), _ids()
    found = budget_allocation(model, ids, POLICY, 0.75)
    cache = kvsieve.compress(model, ids, POLICY, 0.75)
    uniform = kvsieve.compress(model, ids, "trimkv:gates=untrained", 0.75)
    assert found.layers == cache.full_layers, "sliding layers are left out"
    assert found.kept == [cache.stored_lengths()[layer] for layer in found.layers]
    assert found.uniform == [uniform.stored_lengths()[layer] for layer in found.layers]
    assert len({n for heads in found.uniform for n in heads}) == 1, "uniform: every head keeps the same"
    assert len({n for heads in found.kept for n in heads}) > 1, "global: heads earn different shares"
    kept, even = found.layer_totals()
    assert sum(kept) == pytest.approx(sum(even), abs=len(found.layers)), "the same entries in all"
    assert plot_allocation(found, tmp_path / "a.png").stat().st_size > 10_000


def test_allocation_needs_one_prompt():
    with pytest.raises(ValueError, match=r"one prompt \[1, tokens\]"):
        budget_allocation(tiny_llama(), torch.cat([_ids(), _ids()]), "importance+global", 0.5)


def test_allocation_command(model_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 30)
    out = tmp_path / "alloc.png"
    args = ["allocation", "--model", str(model_dir), "--text", str(text), "--tokens", "96", "--out", str(out)]
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--policy", "importance+global", "--rate", "0.8"])
    assert result.exit_code == 0, result.output
    record = json.loads(out.with_suffix(".json").read_text())
    assert out.is_file() and record["policy"] == "importance+global" and record["tokens"] == 96
    assert "layers given most beyond uniform" in result.output
    for bad, hint in ((["--policy", "nope+global"], "--policy"), (["--rate", "1.5"], "--rate")):
        result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, *bad])
        assert result.exit_code == 2 and hint in result.output
