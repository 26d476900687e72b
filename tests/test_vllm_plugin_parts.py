"""The vLLM plugin's parts that need no vLLM: its settings, the engine arguments it fills in, a step's remapping, the
held cache's positions, the packing of cells, kvsieve's attention of ragged requests and the CPU layout it reads
and writes (the engine itself: tests/test_vllm.py, `make vllm`)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from kvsieve.kernels.attention import reference_attention
from kvsieve.selection.budget import MaxTokens, Rate
from kvsieve.selection.observation import LayerFacts
from kvsieve.selection.scorers import SCORERS
from kvsieve.selection.spec import make_policy
from kvsieve.vllm.cells import pack_cells
from kvsieve.vllm.compaction import ReadLayer, WorkerSieve
from kvsieve.vllm.engine import SCHEDULER, SUPPORTED_VLLM, WORKER, prepare_engine_args
from kvsieve.vllm.held import CompactedLayer, HeldCache, RecentMeasures
from kvsieve.vllm.layout import BlockLayout, CPUCacheLayout, read_cells, read_entries, write_cells
from kvsieve.vllm.plan import RowPlan, StepPlan
from kvsieve.vllm.ragged import HeldEntries, ragged_attention
from kvsieve.vllm.settings import PluginConfigError, PluginSettings, unservable

REFUSED = {"kvzip"}  # it reads the model repeating its prompt, a pass vLLM does not make


def test_settings_parse_a_policy_and_a_budget():
    settings = PluginSettings.parse({"policy": "snapkv+global:window=16", "rate": 0.75})
    assert settings.policy.name == "snapkv+global:window=16" and settings.budget == Rate(0.75)
    assert not settings.bounded
    bounded = PluginSettings.parse({"policy": "trimkv", "max_tokens": 256, "buffer": 32, "trace": "t.jsonl"})
    assert bounded.budget == MaxTokens(256) and bounded.bounded and bounded.trace == "t.jsonl"
    assert bounded.policy.name == "trimkv:merge=none"  # a cache that evicts again drops the recorded merge
    assert PluginSettings.parse({"policy": "trimkv"}).policy.name == "trimkv"  # compressed once: as recorded
    assert PluginSettings.parse({}).policy.name == "snapkv"


def test_every_scorer_is_served_or_refused_by_what_it_reads():
    served = {name for name in SCORERS if not unservable(make_policy(name))}
    assert served == set(SCORERS) - REFUSED
    for name in REFUSED:
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
        ({"policy": "snapkv:merge=window", "max_tokens": 64, "buffer": 8}, "cannot keep it true"),
        ({"policy": "snapkv:projection=sentence"}, "sentence projection"),
        ({"policy": "snapkv:kv_bits=4"}, "kv_bits"),
        ({"policy": "kvzip"}, "repeats its prompt"),
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
    assert (args.scheduler_cls, args.worker_cls, args.enable_prefix_caching) == (SCHEDULER, WORKER, None)
    for asked in (True, False):  # prefix caching is left as asked (unset: vLLM's default, on)
        args = engine_args(enable_prefix_caching=asked)
        prepare_engine_args(args, SUPPORTED_VLLM[0])
        assert args.enable_prefix_caching is asked
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
    row = RowPlan("r", 0, 2, computed=20, seen=22, prompt=10, blocks=blocks, evicted=9, due=False)
    fresh = RowPlan(
        "s", 2, 3, computed=5, seen=6, prompt=6, blocks=torch.tensor([1, 2, 0, 0, 0, 0]), evicted=0, due=False
    )
    ragged = RowPlan("t", 3, 5, computed=20, seen=22, prompt=10, blocks=blocks, evicted=9, due=False, ragged=True)
    tallied = RowPlan("u", 5, 8, computed=4, seen=7, prompt=9, blocks=blocks, evicted=0, due=False, tally=True)
    plan = StepPlan((row, fresh, ragged, tallied), num_layers=2, block_size=4)
    table = torch.stack([blocks, fresh.blocks, blocks, blocks])
    metadata = Metadata(table, torch.tensor([22, 6, 22, 7]), torch.tensor([-1, -1, 5, -1, -1, 8, 9, 10]), 22)
    remapped = plan.remap(metadata)
    assert remapped.block_table_tensor[0, :4].tolist() == [9, 4, 5, 6]  # two whole blocks skipped
    # positions 20, 21 -> cache indices 11, 12 -> (block 5, offset 3), (block 6, offset 0)
    assert remapped.slot_mapping[:2].tolist() == [5 * 4 + 3, 6 * 4 + 0]
    assert remapped.slot_mapping[3:5].tolist() == [5 * 4 + 3, 6 * 4 + 0]  # a ragged row writes where any row does
    # vLLM's kernel reads no more of a row kvsieve attends (ragged, or tallied before any eviction) than its queries
    assert remapped.slot_mapping[2] == 5 and remapped.seq_lens.tolist() == [13, 6, 2, 3] and remapped.max_seq_len == 13
    assert (
        remapped.slot_mapping[5:].tolist() == [8, 9, 10] and remapped.block_table_tensor[3].tolist() == blocks.tolist()
    )
    assert plan.blocks_after(row, 9).tolist() == [9, 4, 5, 6]


def test_held_positions_bias_and_recent_measures():
    cells = pack_cells([[3, 2], [1, 2]])  # rows = 2: lane (0, 0) puts its third entry in lane (1, 0)'s spare cell
    positions = torch.tensor([[0, 4, 7], [1, 9, -1]])
    bias = torch.tensor([[0.0, 0.0, 1.5], [0.0, 0.0, float("-inf")]])
    held = HeldCache(evicted=10, rows=2, compacted={0: CompactedLayer(cells.layers[0], positions, bias)})
    assert held.positions(0, 2, 4).tolist() == [[0, 4, 7, 12, 13], [1, 9, 12, 13, -1]]
    assert held.bias(0, 2, 4).tolist() == [[0, 0, 1.5, 0, 0], [0, 0, 0, 0, float("-inf")]]
    tail = held.cells(0, 2, 4)
    assert tail.count.tolist() == [5, 4]
    assert tail.layer.tolist() == [[0, 0, 1, 0, 0], [0, 0, 0, 0, 0]]
    assert tail.index[:, :4].tolist() == [[0, 1, 1, 2], [0, 1, 2, 3]]
    recent = RecentMeasures(window=3)
    recent.append({"queries": torch.arange(8.0).view(4, 2, 1).transpose(0, 1)}, torch.arange(4))
    recent.append({"queries": torch.tensor([[[8.0]], [[9.0]]])}, torch.tensor([4]))
    queries = recent.measured["queries"]
    assert recent.positions.tolist() == [2, 3, 4] and queries[:, :, 0].tolist() == [[4, 6, 8], [5, 7, 9]]


@pytest.mark.parametrize(
    "counts",
    [[[5, 5], [5, 5]], [[9, 1], [3, 0]], [[0, 0, 7], [2, 11, 1], [4, 4, 4]], [[130, 2], [1, 300]]],
)
def test_cells_hold_every_entry_once_in_the_mean_count(counts):
    packing = pack_cells(counts)
    lanes = sum(len(layer) for layer in counts)
    assert packing.rows == -(-sum(map(sum, counts)) // lanes)  # the mean count, not the largest
    assert packing.identity == (len({n for layer in counts for n in layer}) == 1)
    used = []
    for layer, cells in enumerate(packing.layers):
        assert cells.count.tolist() == counts[layer]
        for head, n in enumerate(counts[layer]):
            lanes = zip(cells.layer[head, :n], cells.head[head, :n], cells.index[head, :n], strict=True)
            at = [(int(a), int(b), int(c)) for a, b, c in lanes]
            home = min(n, packing.rows)
            assert at[:home] == [(layer, head, i) for i in range(home)]  # its own lane first
            used += at
    assert len(set(used)) == len(used) and all(index < packing.rows for _, _, index in used)


def test_cells_are_written_and_read_back_across_layers():
    blocks, heads, size, dim = 4, 2, 4, 3
    vec = BlockLayout.transposed_keys(heads, size, dim)
    caches = {layer: torch.zeros(blocks, heads, size, 2 * dim) for layer in range(2)}
    packing = pack_cells([[9, 1], [3, 0]])  # rows 4: one block of 4 in every lane, lane (0, 0) spills into others
    order = torch.tensor([2])
    written = []
    for cells in packing.layers:  # every layer written before any is read: no layer's cells overwrite another's
        keys, values = torch.randn(heads, cells.index.shape[1], dim), torch.randn(heads, cells.index.shape[1], dim)
        write_cells(caches, order, cells, keys, values, vec)
        written.append((keys, values))
    for cells, (keys, values) in zip(packing.layers, written, strict=True):
        read_keys, read_values = read_cells(caches, order, cells, vec)
        valid = cells.valid
        assert torch.equal(read_keys[valid], keys[valid]) and torch.equal(read_values[valid], values[valid])
    assert all(bool(cache[[0, 1, 3]].eq(0).all()) for cache in caches.values())  # other blocks untouched


@pytest.mark.parametrize("tiled", [True, False])
def test_cells_are_read_whole_tiles_at_a_time_or_number_by_number_alike(tiled):
    heads, size, dim = 2, 8, 4
    vec = BlockLayout.transposed_keys(heads, size, dim)
    assert vec.tiles is not None  # the vec layout is one tile per (block, head): keys transposed, values as they are
    layout = vec if tiled else BlockLayout(vec.keys.flip(1), vec.values.flip(1))  # offsets reversed: no bit order
    assert (layout.tiles is None) is not tiled
    caches = {layer: torch.randn(5, heads, size, 2 * dim) for layer in range(2)}
    packing = pack_cells([[13, 2], [6, 1]])
    for layer, cells in enumerate(packing.layers):
        cells = cells.with_tail(layer, packing.rows, packing.rows + 3)
        keys, values = read_cells(caches, torch.tensor([3, 1, 4]), cells, layout)
        block = torch.tensor([3, 1, 4])[cells.index // size]
        flat = {index: cache.view(5, -1) for index, cache in caches.items()}
        for head, column in zip(*cells.valid.nonzero(as_tuple=True), strict=True):
            at = flat[int(cells.layer[head, column])][block[head, column]]
            lane, offset = cells.head[head, column], cells.index[head, column] % size
            assert torch.equal(keys[head, column], at[layout.keys[lane, offset]])
            assert torch.equal(values[head, column], at[layout.values[lane, offset]])


def test_ragged_attention_is_exact_with_merged_entries_and_a_causal_tail():
    torch.manual_seed(0)
    kv_heads, q_heads, width, dim, n = 2, 4, 6, 8, 3
    keys, values = torch.randn(kv_heads, width, dim).double(), torch.randn(kv_heads, width, dim).double()
    positions = torch.tensor([[0, 3, -1, 10, 11, 12], [2, -1, 10, 11, 12, -1]])  # -1: merged (valid) or padding
    valid = torch.tensor([[True] * 6, [True] * 5 + [False]])
    bias = torch.tensor([[0, 0, 1.3, 0, 0, 0], [0, -0.4, 0, 0, 0, float("-inf")]]).double()
    query = torch.randn(n, q_heads, dim).double()
    facts = LayerFacts(scaling=0.3, q_heads=q_heads)
    entries = HeldEntries(keys, values, positions, valid)
    got, received = ragged_attention(query, entries, bias, torch.tensor([10, 11, 12]), facts)
    visible = (positions[:, None, :] <= torch.tensor([10, 11, 12])[None, :, None]) & valid[:, None, :]
    additive = torch.where(visible, bias[:, None, :], float("-inf"))
    expected = reference_attention(query.transpose(0, 1)[None], keys[None], values[None], additive[None], 0.3)[0]
    assert torch.allclose(got, expected, atol=1e-12) and received is None


def test_tallied_attention_adds_what_each_position_received():
    torch.manual_seed(1)
    kv_heads, q_heads, dim = 2, 4, 8
    keys, values = torch.randn(kv_heads, 5, dim), torch.randn(kv_heads, 5, dim)
    positions = torch.tensor([[0, 2, 5, 6, -1], [0, 1, 5, 6, 7]])  # head 0: four entries and padding
    valid = torch.tensor([[True] * 4 + [False], [True] * 5])
    entries, facts = HeldEntries(keys, values, positions, valid), LayerFacts(scaling=0.3, q_heads=q_heads)
    query = torch.randn(2, q_heads, dim)
    out, received = ragged_attention(query, entries, None, torch.tensor([6, 7]), facts, tally=True)
    plain, _ = ragged_attention(query, entries, None, torch.tensor([6, 7]), facts)
    assert torch.allclose(out, plain, atol=1e-5)
    held = HeldCache()
    held.add_received(0, entries, received)
    held.add_received(0, entries, received)  # a second step's queries add to the same positions
    per_head = held.received_at(0, entries)  # [q_heads, width]
    visible = (positions[:, None, :] <= torch.tensor([6, 7])[None, :, None]) & valid[:, None, :]
    scores = torch.einsum("nhd,hwd->hnw", query, keys.repeat_interleave(2, 0)) * 0.3
    probs = scores.masked_fill(~visible.repeat_interleave(2, 0), float("-inf")).softmax(-1).nan_to_num()
    assert torch.allclose(per_head, 2 * probs.sum(1), atol=1e-5)
    assert held.received[0].shape[1] >= 8 and float(held.received[0][0, 7]) == 0.0  # head 0 holds no position 7


def test_a_request_held_at_a_size_is_observed_as_bounded():
    """What a compaction scores says whether the request is compressed once (a rate) or held at a size while it
    generates (`max_tokens` with `buffer`): `trimkv` reads its checkpoint's horizon for that case."""
    entries = torch.zeros(1, 8, 4)
    read = ReadLayer(LayerFacts(scaling=0.5, q_heads=2), HeldEntries(entries, entries, torch.arange(8)[None], None))
    row = RowPlan("r", 0, 8, computed=0, seen=8, prompt=8, blocks=torch.zeros(2), evicted=0, due=True)
    for entry, bounded in [({"rate": 0.5}, False), ({"max_tokens": 4, "buffer": 2}, True)]:
        settings = PluginSettings.parse({"policy": "trimkv", **entry})
        sieve = WorkerSieve(settings, None, CPUCacheLayout(), held={"r": HeldCache()})
        (observation,) = sieve.observations(row, {0: read})
        assert observation.bounded is bounded and observation.positions.tolist() == [list(range(8))]


def test_read_entries_follows_the_vec_layout():
    """The ``vec`` kernels' layout: keys transposed per (block, head) `[head_dim, block_size]`, then values
    `[block_size, head_dim]` (what vLLM's kernel writes: tests/test_vllm.py)."""
    blocks, heads, size, dim = 3, 2, 4, 2
    keys, values = torch.randn(blocks, heads, dim, size), torch.randn(blocks, heads, size, dim)
    cache = torch.cat([keys.flatten(2), values.flatten(2)], dim=2).view(blocks, heads, size, 2 * dim)
    read_keys, read_values = read_entries(cache, torch.tensor([2, 0]), 6, BlockLayout.transposed_keys(heads, size, dim))
    for index in range(6):
        block, offset = (2, 0)[index // size], index % size
        assert torch.equal(read_keys[:, index], keys[block, :, :, offset])
        assert torch.equal(read_values[:, index], values[block, :, offset])
