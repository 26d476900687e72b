"""A gate checkpoint's recorded merge: what a policy that reads those gates and names no merge folds evictions with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import kvsieve
from kvsieve.runtime.api.evictions import Eviction, evictions
from kvsieve.runtime.observing.prefill import observe_prefill
from kvsieve.selection.checkpoint import GateCheckpointError, gates_fingerprint, read_gates
from kvsieve.selection.merge import NO_MERGE, OutputMerge, WindowMerge
from kvsieve.selection.observation import Needs
from kvsieve.selection.spec import make_policy
from kvsieve.vllm.settings import PluginSettings
from test_recorded_projection import _same, save_random_gates


@pytest.fixture
def recording(model, tmp_path) -> str:
    """Random gates for the tiny Llama whose checkpoint records `merge=output`."""
    return save_random_gates(model, tmp_path / "merging", merge=OutputMerge())


def _same_merged(a: kvsieve.SievedCache, b: kvsieve.SievedCache) -> bool:
    """Whether every layer of both holds the same merged entries, or both none."""
    return all(
        (x.merged is None and y.merged is None)
        or (
            x.merged is not None
            and y.merged is not None
            and all(map(torch.equal, vars(x.merged).values(), vars(y.merged).values()))
        )
        for x, y in zip(a.layers, b.layers, strict=True)
    )


def _same_caches(a: kvsieve.SievedCache, b: kvsieve.SievedCache) -> bool:
    """Whether both keep the same positions (`_same`) and hold the same merged entries (or none)."""
    return _same(a, b) and _same_merged(a, b)


def test_the_checkpoint_keeps_the_merge(model, recording, tmp_path):
    """Saved and read back; it changes the fingerprint, and gates recording none hash as before merges existed."""
    assert read_gates(recording)[0].merge == OutputMerge()
    plain = save_random_gates(model, tmp_path / "plain")
    assert read_gates(plain)[0].merge is None and "merge" not in json.loads(Path(plain, "config.json").read_text())
    assert gates_fingerprint(read_gates(recording)[0]) != gates_fingerprint(read_gates(plain)[0])
    parts = save_random_gates(model, tmp_path / "parts", merge=WindowMerge(parts=3))
    assert read_gates(parts)[0].merge == WindowMerge(parts=3)
    config = Path(recording, "config.json")
    config.write_text(config.read_text().replace('"merge": "output"', '"merge": "sum"'))
    with pytest.raises(GateCheckpointError, match=r"config.json: unknown merge 'sum'; known: mean, window, output"):
        read_gates(recording)


def test_a_policy_naming_no_merge_folds_with_the_recorded_one(model, ids, recording, tmp_path):
    """`trimkv:gates=DIR` compresses exactly as `...,merge=output` does (kept entries and merged ones); `merge=none`
    exactly as the same weights recording no merge."""
    recorded = kvsieve.compress(model, ids, f"trimkv+global:gates={recording}", rate=0.7)
    named = kvsieve.compress(model, ids, f"trimkv+global:gates={recording},merge=output", rate=0.7)
    assert _same_caches(recorded, named)
    assert all(layer.merged is not None for layer in recorded.layers)
    plain = kvsieve.compress(model, ids, f"trimkv+global:gates={save_random_gates(model, tmp_path / 'p')}", rate=0.7)
    dropped = kvsieve.compress(model, ids, f"trimkv+global:gates={recording},merge=none", rate=0.7)
    assert _same_caches(dropped, plain) and all(layer.merged is None for layer in dropped.layers)
    assert not _same_caches(recorded, plain)


def test_one_prefill_records_what_the_recorded_merge_reads(model, ids, recording):
    """The policy reads no window; the prefill records the recorded merge's, and the harness's evictions of it
    (prefill once, sieve many) attach the same merged entries as `compress`."""
    policy = f"trimkv+global:gates={recording}"
    assert make_policy(policy).needs.window == 0
    prefill = observe_prefill(model, ids, make_policy(policy).needs)
    assert prefill.observations[0][0].stats.window_queries.shape[1] == WindowMerge.WINDOW
    rows = evictions(prefill, [Eviction(policy, 0.7), Eviction(f"{policy},merge=none", 0.7)])
    alone = kvsieve.compress(model, ids, policy, rate=0.7)
    for layer, compressed in zip(rows.layers, alone.layers, strict=True):
        torch.testing.assert_close(layer.merged.keys[0], compressed.merged.keys[0], atol=0, rtol=0)
        torch.testing.assert_close(layer.merged.bias[0], compressed.merged.bias[0], atol=0, rtol=0)
        assert bool(torch.isneginf(layer.merged.bias[1]).all())  # the merge=none row holds none


def test_caches_that_evict_again_do_without_the_recorded_merge(model, ids, recording):
    """A bounded cache and the vLLM plugin holding a size take the policy and keep no merged entry (a named merge
    stays refused); the plugin compressing each prompt once keeps the recorded merge, as `compress` does."""
    policy = f"trimkv+global:gates={recording}"
    bounded = kvsieve.compress(model, ids, policy, max_tokens=40, buffer=8)
    assert _same_caches(bounded, kvsieve.compress(model, ids, f"{policy},merge=none", max_tokens=40, buffer=8))
    assert all(layer.merged is None for layer in bounded.layers)
    held = PluginSettings.parse({"policy": f"trimkv:gates={recording}", "max_tokens": 40, "buffer": 8})
    assert held.policy.merge == NO_MERGE
    once = PluginSettings.parse({"policy": f"trimkv:gates={recording}", "rate": 0.5})
    assert once.policy.merge is None and once.chunk_policy.merge == NO_MERGE  # its chunked prompts evict again


def test_a_merge_fills_the_slots_of_its_bytes(model, ids):
    """Stored in the model's dtype, a merged entry beside 4-bit entries takes the slots its bytes fill: a byte
    budget holds no more bytes with a merge than without, and at most one full-precision entry a head fewer."""
    budget = kvsieve.compress(model, ids, "snapkv", rate=0.0).nbytes() // 3
    plain = kvsieve.compress(model, ids, "snapkv:kv_bits=4", max_bytes=budget)
    merged = kvsieve.compress(model, ids, "snapkv:kv_bits=4,merge=mean", max_bytes=budget)
    heads = sum(len(per_layer) for per_layer in merged.stored_lengths())
    full_entry = 2 * model.config.head_dim * 4  # float32 key and value
    assert plain.nbytes() - heads * full_entry <= merged.nbytes() <= plain.nbytes()
    assert sum(map(sum, merged.stored_lengths())) < sum(map(sum, plain.stored_lengths())) - heads


def test_needs_of_no_merge():
    assert NO_MERGE.needs == Needs() and make_policy("snapkv:merge=none").name == "snapkv:merge=none"
    assert not make_policy("snapkv:merge=none").names_merge and make_policy("snapkv:merge=mean").names_merge
