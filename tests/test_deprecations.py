"""kvsieve 0.1's keywords keep working through 0.3: each warns, names the new keyword, and means the same."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import kvsieve
from kvsieve.harness.cli import _capacity_and_scope, app
from kvsieve.selection.checkpoint import TrainRecord


def _kept(cache: kvsieve.SievedCache) -> list[list[torch.Tensor]]:
    return [cache.kept_positions(layer) for layer in range(len(cache.layers))]


def _same(a: kvsieve.SievedCache, b: kvsieve.SievedCache) -> bool:
    return all(
        torch.equal(x, y) for la, lb in zip(_kept(a), _kept(b), strict=True) for x, y in zip(la, lb, strict=True)
    )


@torch.no_grad()
def test_compress_budget_and_sliding_window_are_the_allocator_and_n_recent(model, ids):
    with pytest.warns(DeprecationWarning, match=r"budget= is deprecated .*use allocator="):
        old = kvsieve.compress(model, ids, "snapkv", 0.8, budget="adaptive")
    assert _same(old, kvsieve.compress(model, ids, "snapkv", 0.8, allocator="adaptive"))
    with pytest.warns(DeprecationWarning, match=r"sliding_window= is deprecated .*use n_recent="):
        old = kvsieve.compress(model, ids, "snapkv", 0.8, sliding_window=4)
    assert _same(old, kvsieve.compress(model, ids, "snapkv", 0.8, n_recent=4))
    assert not _same(old, kvsieve.compress(model, ids, "snapkv", 0.8)), "n_recent=4 keeps other entries"
    with pytest.warns(DeprecationWarning, match="budget="):
        bounded = kvsieve.bounded_cache(model, "knorm", max_tokens=40, budget="global")
    assert bounded.growth.policy.allocator.name == "global"


def test_make_policy_and_spec_text():
    with pytest.warns(DeprecationWarning, match=r"use allocator="):
        assert kvsieve.make_policy("snapkv", budget="global").name == "snapkv+global"
    with pytest.warns(DeprecationWarning, match=r"policy 'snapkv:sliding_window=4': sliding_window= .*use n_recent="):
        assert kvsieve.make_policy("snapkv:sliding_window=4").name == "snapkv:n_recent=4"
    with pytest.warns(DeprecationWarning), pytest.raises(kvsieve.PolicyError, match="give n_recent= only"):
        kvsieve.make_policy("snapkv", n_recent=4, sliding_window=4)
    with pytest.warns(DeprecationWarning), pytest.raises(kvsieve.PolicyError, match="give the allocator once"):
        kvsieve.make_policy("snapkv", "global", budget="global")


def test_eviction_config_takes_the_names_of_kvsieve_0_1():
    new = kvsieve.EvictionConfig(policy="snapkv", rate=0.8, allocator="adaptive", n_recent=8)
    with pytest.warns(DeprecationWarning) as caught:
        old = kvsieve.EvictionConfig(eviction_rate=0.8, eviction_mode="snapkv", budget="adaptive", sliding_window=8)
    named = {str(w.message).split(":")[1].split("=")[0].strip() for w in caught}
    assert named == {"eviction_rate", "eviction_mode", "budget", "sliding_window"}
    assert old == new and old.resolved == new.resolved and old.resolved.name == "snapkv+adaptive:n_recent=8"
    with pytest.warns(DeprecationWarning), pytest.raises(kvsieve.PolicyError, match="give rate= only"):
        kvsieve.EvictionConfig(rate=0.5, eviction_rate=0.5)
    with pytest.raises(kvsieve.PolicyError, match=r"takes the policy first, got 0\.5: give the eviction rate as rate="):
        kvsieve.EvictionConfig(0.5)


def test_train_gates_options_of_kvsieve_0_1():
    assert _capacity_and_scope(None, None, None) == (128, "global")
    assert _capacity_and_scope("64", "head", None) == (64, "head")
    assert _capacity_and_scope("head", None, 32) == (32, "head"), "--capacity head --budget 32, as 0.1 spelled it"
    runner = CliRunner(env={"COLUMNS": "200"})
    result = runner.invoke(app, ["train-gates", "--out", "unused", "--budget", "16", "--capacity", "8"])
    assert (
        result.exit_code == 2 and "--budget is deprecated" in result.output and "give --capacity only" in result.output
    )


def test_checkpoints_written_by_kvsieve_0_1_are_read():
    old = {"model_name": "m", "model_hash": "h", "budget": 128, "capacity": "global", "lam": 1.0}
    record = TrainRecord.from_dict(old | {"steps": 1, "seq_len": 8, "seed": 0})
    assert (record.capacity, record.scope) == (128, "global")
