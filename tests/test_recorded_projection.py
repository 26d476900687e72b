"""A gate checkpoint's recorded projection: what a policy that reads those gates and names no projection picks with."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import kvsieve
from kvsieve.harness.cli import app
from kvsieve.harness.eval.methods import Case, KvsievePolicy
from kvsieve.modeling.gates import NEXT_STEP, Horizons, RetentionGates, gate_shape
from kvsieve.selection.checkpoint import (
    SHIPPED,
    GateCheckpointError,
    TrainRecord,
    model_fingerprint,
    read_gates,
    save_gates,
)
from kvsieve.selection.projection import Sentences
from kvsieve.selection.spans import sentence_spans

TEXT = " ".join(["The grass is green. Who is the mother of Carol? I don't know!"] * 6)
RECORDED = Sentences(best_tokens=0.1)


def save_random_gates(
    model: torch.nn.Module,
    folder: Path,
    projection: object | None = None,
    *,
    seed: int = 0,
    seconds: float = 1.0,
    horizons: Horizons = NEXT_STEP,
    merge: object | None = None,
) -> str:
    """Random gates for `model` (drawn from `seed`), saved to `folder` with `projection`, `horizons` and `merge`
    recorded and `seconds` of training; the folder as a string."""
    torch.manual_seed(seed)
    gates = RetentionGates(gate_shape(model, width=8), horizons=horizons, projection=projection, merge=merge)
    torch.nn.init.normal_(gates.scoring.weight)
    record = TrainRecord("tiny", model_fingerprint(model), 8, "global", 1.0, 3, 48, seed, {}, seconds)
    return str(save_gates(gates, record, folder))


def _kept(cache: kvsieve.SievedCache) -> list[list[torch.Tensor]]:
    return [cache.kept_positions(layer) for layer in range(3)]


def _same(a: kvsieve.SievedCache, b: kvsieve.SievedCache) -> bool:
    return all(
        torch.equal(x, y) for la, lb in zip(_kept(a), _kept(b), strict=True) for x, y in zip(la, lb, strict=True)
    )


def test_the_checkpoint_keeps_the_projection(lm, tmp_path):
    folder = save_random_gates(lm, tmp_path / "gates", RECORDED)
    assert json.loads((Path(folder) / "config.json").read_text())["projection"] == {
        "name": "sentence",
        "best_tokens": 0.1,
    }
    assert read_gates(folder)[0].projection == RECORDED
    assert read_gates(save_random_gates(lm, tmp_path / "plain", None))[0].projection is None
    assert "projection" not in json.loads((tmp_path / "plain" / "config.json").read_text())


@torch.no_grad()
def test_a_policy_that_names_none_picks_with_the_recorded_projection(lm, tok, tmp_path):
    """With sentences at hand, `trimkv+global:gates=DIR` keeps what the named recorded projection keeps, and differs
    from topk; its name stays the one given."""
    ids = tok(TEXT, return_tensors="pt").input_ids
    folder = save_random_gates(lm, tmp_path / "gates", RECORDED)
    spec = f"trimkv+global:gates={folder}"
    assert kvsieve.make_policy(spec).name == spec
    recorded = kvsieve.compress(lm, ids, spec, 0.7, tokenizer=tok)
    named = kvsieve.compress(
        lm, ids, f"{spec},projection=sentence,best_tokens=0.1", 0.7, spans=sentence_spans(tok, ids)
    )
    topk = kvsieve.compress(lm, ids, f"{spec},projection=topk", 0.7, tokenizer=tok)
    assert _same(recorded, named) and not _same(recorded, topk)
    given = kvsieve.compress(lm, ids, spec, 0.7, spans=sentence_spans(tok, ids))
    assert _same(given, named)
    out = kvsieve.generate(lm, ids, spec, rate=0.7, max_new_tokens=3, do_sample=False, tokenizer=tok)
    context = ids[:, :-1]  # generate compresses all but the prompt's last token
    expected = kvsieve.generate(
        lm,
        ids,
        f"{spec},projection=sentence,best_tokens=0.1",
        rate=0.7,
        max_new_tokens=3,
        do_sample=False,
        spans=sentence_spans(tok, context),
    )
    assert torch.equal(out, expected)


@torch.no_grad()
def test_without_sentences_it_says_so_and_keeps_topk(lm, tok, tmp_path):
    ids = tok(TEXT, return_tensors="pt").input_ids
    spec = f"trimkv+global:gates={save_random_gates(lm, tmp_path / 'gates', RECORDED)}"
    with pytest.warns(UserWarning, match=r"record projection=sentence,best_tokens=0.1 .* Pass tokenizer="):
        alone = kvsieve.compress(lm, ids, spec, 0.7)
    assert _same(alone, kvsieve.compress(lm, ids, f"{spec},projection=topk", 0.7))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvsieve.compress(lm, ids, f"{spec},projection=topk", 0.7)  # named: no warning
        plain = f"trimkv+global:gates={save_random_gates(lm, tmp_path / 'plain', None)}"
        kvsieve.compress(lm, ids, plain, 0.7)  # recorded none: topk, no warning


def test_the_harness_gives_a_policy_reading_gates_its_sentences(lm, tok, tmp_path):
    ids = tok(TEXT, return_tensors="pt").input_ids
    case = Case(ids, ids.shape[1], tokenizer=tok)
    gated = KvsievePolicy(
        kvsieve.make_policy(f"trimkv+global:gates={save_random_gates(lm, tmp_path / 'gates', RECORDED)}")
    )
    assert torch.equal(gated.eviction(case, 0.5).spans, sentence_spans(tok, ids[0]))
    assert KvsievePolicy(kvsieve.make_policy("snapkv")).eviction(case, 0.5).spans is None


def test_a_bad_recorded_projection_is_a_clear_error(lm, tmp_path):
    folder = Path(save_random_gates(lm, tmp_path / "gates", RECORDED))
    config = json.loads((folder / "config.json").read_text())
    for bad, message in [
        ({"name": "span"}, "unknown projection 'span'"),
        ({"name": "sentence", "best_tokens": 2}, r"best_tokens must be a number in \[0, 1\)"),
        ({"name": "sentence", "chunk_size": 4}, "projection sentence: .*chunk_size"),
        ("sentence", "a projection is recorded as"),
    ]:
        (folder / "config.json").write_text(json.dumps(config | {"projection": bad}))
        with pytest.raises(GateCheckpointError, match=f"config.json: {message}"):
            read_gates(folder)


def test_train_gates_refuses_a_bad_projection_before_training(model_dir, tmp_path):
    args = ["train-gates", "--model", str(model_dir), "--steps", "1", "--out", str(tmp_path / "g")]
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--projection", "sentence,chunk_size=4"])
    assert result.exit_code == 2 and "chunk_size is a parameter of projection=chunk" in result.output
    assert not (tmp_path / "g").exists()


def test_the_shipped_gemma_gates_record_whole_sentences_beyond_the_best_tenth():
    """The measured choice (docs/benchmarks.md, Gemma's 60 needles): `sentence,best_tokens=0.1`; the default
    model's gates record none (topk)."""
    assert read_gates(SHIPPED / "gemma3-270m")[0].projection == RECORDED
    assert read_gates(SHIPPED / "smollm2-135m")[0].projection is None
