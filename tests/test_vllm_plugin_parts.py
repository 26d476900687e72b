"""The vLLM plugin's parts that need no vLLM: its settings, the engine arguments it fills in, a step's remapping, the
held cache's positions and the CPU layout it reads (the engine itself: tests/test_vllm.py, `make vllm`)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from kvsieve.selection.budget import MaxTokens, Rate
from kvsieve.selection.observation import LayerFacts
from kvsieve.selection.scorers import SCORERS
from kvsieve.selection.spec import make_policy
from kvsieve.vllm.compaction import ReadLayer, WorkerSieve
from kvsieve.vllm.engine import SCHEDULER, SUPPORTED_VLLM, WORKER, prepare_engine_args
from kvsieve.vllm.held import HeldCache, RecentMeasures
from kvsieve.vllm.layout import read_entries
from kvsieve.vllm.plan import RowPlan, StepPlan
from kvsieve.vllm.settings import PluginConfigError, PluginSettings, unservable

SERVED = {"knorm", "keydiff", "streaming", "random", "trimkv", "snapkv", "window", "tova", "expected", "caote"}


def test_settings_parse_a_policy_and_a_budget():
    settings = PluginSettings.parse({"policy": "snapkv:window=16", "rate": 0.75})
    assert settings.policy.name == "snapkv:window=16" and settings.budget == Rate(0.75) and not settings.bounded
    bounded = PluginSettings.parse({"policy": "trimkv", "max_tokens": 256, "buffer": 32, "trace": "t.jsonl"})
    assert bounded.budget == MaxTokens(256) and bounded.bounded and bounded.trace == "t.jsonl"
    assert PluginSettings.parse({}).policy.name == "snapkv"


def test_every_scorer_is_served_or_refused_by_what_it_reads():
    served = {name for name in SCORERS if not unservable(make_policy(name))}
    assert served == SERVED
    for name in set(SCORERS) - SERVED:
        with pytest.raises(PluginConfigError, match=f"cannot serve '{name}'"):
            PluginSettings.parse({"policy": name})


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("snapkv", "must be a dict"),
        ({"policy": "snapkv", "window": 8}, "does not know ['window']"),
        ({"policy": "unknown"}, "unknown"),
        ({"rate": 0.5, "max_tokens": 10}, "rate and max_tokens"),
        ({"rate": 1.5}, "eviction rate must be in [0, 1)"),
        ({"rate": 0.5, "buffer": 8}, "give max_tokens with it"),
        ({"max_tokens": 64, "buffer": 0}, "buffer must be an integer >= 1"),
        ({"policy": "snapkv+global"}, "global allocator"),
        ({"policy": "snapkv:projection=sentence"}, "sentence projection"),
        ({"policy": "snapkv:kv_bits=4"}, "kv_bits"),
        ({"policy": "dropkv"}, "attention output"),
        ({"policy": "critical"}, "output projection"),
    ],
)
def test_bad_settings_are_named(entry, message):
    with pytest.raises(PluginConfigError) as err:
        PluginSettings.parse(entry)
    assert message in str(err.value)


def engine_args(**fields) -> SimpleNamespace:
    defaults = {"additional_config": {"kvsieve": {"policy": "knorm"}}, "enable_prefix_caching": None}
    return SimpleNamespace(**(defaults | {"scheduler_cls": None, "worker_cls": "auto"} | fields))


def test_engine_arguments_are_filled_in_or_refused():
    args = engine_args()
    prepare_engine_args(args, SUPPORTED_VLLM[0])
    assert (args.scheduler_cls, args.worker_cls, args.enable_prefix_caching) == (SCHEDULER, WORKER, False)
    with pytest.raises(PluginConfigError, match="prefix caching"):
        prepare_engine_args(engine_args(enable_prefix_caching=True), SUPPORTED_VLLM[0])
    with pytest.raises(PluginConfigError, match="its own scheduler_cls"):
        prepare_engine_args(engine_args(scheduler_cls="my.Scheduler"), SUPPORTED_VLLM[0])
    with pytest.raises(PluginConfigError, match=r"this is vLLM 0\.33\.0"):
        prepare_engine_args(engine_args(), "0.33.0")


@dataclass
class Metadata:
    """The fields of vLLM's common attention metadata a step remaps."""

    block_table_tensor: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    max_seq_len: int


def test_a_compacted_row_writes_at_its_position_less_the_evicted():
    blocks = torch.tensor([7, 3, 9, 4, 5, 6])  # blocks of 4 tokens; 9 evicted: 2 blocks freed, cache index = p - 9
    row = RowPlan("r", 0, 2, computed=20, seen=22, blocks=blocks, evicted=9, due=False)
    fresh = RowPlan("s", 2, 3, computed=5, seen=6, blocks=torch.tensor([1, 2, 0, 0, 0, 0]), evicted=0, due=False)
    plan = StepPlan((row, fresh), num_layers=2, block_size=4)
    metadata = Metadata(torch.stack([blocks, fresh.blocks]), torch.tensor([22, 6]), torch.tensor([-1, -1, 5]), 22)
    remapped = plan.remap(metadata)
    assert remapped.block_table_tensor[0, :4].tolist() == [9, 4, 5, 6]  # two whole blocks skipped
    # positions 20, 21 -> cache indices 11, 12 -> (block 5, offset 3), (block 6, offset 0)
    assert remapped.slot_mapping[:2].tolist() == [5 * 4 + 3, 6 * 4 + 0]
    assert remapped.slot_mapping[2] == 5 and remapped.seq_lens.tolist() == [13, 6] and remapped.max_seq_len == 13
    assert plan.destination(row, 9, 5).tolist() == [36, 37, 38, 39, 16]


def test_held_positions_and_recent_measures():
    held = HeldCache(evicted=10, kept={0: torch.tensor([[0, 4, 7], [1, 2, 9]])})
    assert held.compacted == 3
    assert held.positions(0, 2, 5).tolist() == [[0, 4, 7, 13, 14], [1, 2, 9, 13, 14]]
    recent = RecentMeasures(window=3)
    recent.append({"queries": torch.arange(8.0).view(4, 2, 1).transpose(0, 1)}, torch.arange(4))
    recent.append({"queries": torch.tensor([[[8.0]], [[9.0]]])}, torch.tensor([4]))
    queries = recent.measured["queries"]
    assert recent.positions.tolist() == [2, 3, 4] and queries[:, :, 0].tolist() == [[4, 6, 8], [5, 7, 9]]


def test_a_request_held_at_a_size_is_observed_as_bounded():
    """What a compaction scores says whether the request is compressed once (a rate) or held at a size while it
    generates (`max_tokens` with `buffer`): `trimkv` reads its checkpoint's horizon for that case."""
    entries = torch.zeros(1, 8, 4)
    read = ReadLayer(None, "auto", entries, LayerFacts(scaling=0.5, q_heads=2), entries, entries, torch.arange(8)[None])
    row = RowPlan("r", 0, 8, computed=0, seen=8, blocks=torch.zeros(2), evicted=0, due=True)
    for entry, bounded in [({"rate": 0.5}, False), ({"max_tokens": 4, "buffer": 2}, True)]:
        settings = PluginSettings.parse({"policy": "trimkv", **entry})
        (observation,) = WorkerSieve(settings, runner=None, held={"r": HeldCache()}).observations(row, {0: read})
        assert observation.bounded is bounded and observation.positions.tolist() == [list(range(8))]


def test_read_entries_follows_the_cpu_layout():
    """Keys transposed per (block, head) `[head_dim, block_size]`, then values `[block_size, head_dim]`."""
    blocks, heads, size, dim = 3, 2, 4, 2
    keys, values = torch.randn(blocks, heads, dim, size), torch.randn(blocks, heads, size, dim)
    cache = torch.cat([keys.flatten(2), values.flatten(2)], dim=2).view(blocks, heads, size, 2 * dim)
    read_keys, read_values = read_entries(cache, torch.tensor([2, 0]), 6)
    for index in range(6):
        block, offset = (2, 0)[index // size], index % size
        assert torch.equal(read_keys[:, index], keys[block, :, :, offset])
        assert torch.equal(read_values[:, index], values[block, :, offset])
