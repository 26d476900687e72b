"""`--policies` of the needle benchmarks: semicolon-separated specs, an empty list refused before any model loads."""

from __future__ import annotations

import argparse

import pytest

from test_docs import _benchmarks_module

policy_args = _benchmarks_module("policy_args")


def test_specs_split_on_semicolons_and_keep_their_own_commas():
    parser = argparse.ArgumentParser()
    text = " trimkv+global ;;trimkv+global:safeguard=0.5,horizon=inf; "
    assert policy_args.policy_list(parser, text) == ["trimkv+global", "trimkv+global:safeguard=0.5,horizon=inf"]


@pytest.mark.parametrize("script", ["forced_needles", "gate_ablation", "needle_depth", "needle_tokens"])
def test_an_empty_policy_list_is_refused_before_the_model_loads(script, monkeypatch, capsys):
    module = _benchmarks_module(script)
    for loader in ("load_model", "ModelChoice"):  # how the scripts load their model
        if hasattr(module, loader):
            monkeypatch.setattr(module, loader, _no_model)
    monkeypatch.setattr("sys.argv", [f"{script}.py", "--policies", " ; "])
    with pytest.raises(SystemExit):
        module.main()
    assert "--policies names no policy" in capsys.readouterr().err


def _no_model(*args, **kwargs):
    raise AssertionError("the model loaded before --policies was checked")
