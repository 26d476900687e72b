"""The worker's side of the plugin: plan each step, record window queries, score with `kvsieve.selection`, compact.

Scoring reads exactly what `kvsieve.compress` reads, built from vLLM's own cache: every layer's keys
and values, their positions and what the last window queries yielded; `Policy.select` decides over all layers at
once (the allocator and the budget see the whole request). The kept entries of every (layer, kv-head)
are written to the front of the request's blocks, the blocks in front of them are reported to the
scheduler, which gives them back to vLLM's pool.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ..modeling.gates import RetentionGates
from ..modeling.rotary import Rotary
from ..selection.observation import LayerFacts, Observation, Statistics
from .held import HeldCache, RecentMeasures
from .layout import check_layout, read_entries, write_entries
from .plan import RowPlan, StepPlan
from .settings import PluginSettings


@dataclass
class ReadLayer:
    """One layer's entries of one due request, read after the step's attention, and where to write them back."""

    layer: torch.nn.Module
    kv_cache_dtype: str
    kv_cache: torch.Tensor
    facts: LayerFacts
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor


@dataclass
class WorkerSieve:
    """One worker's plugin state: the settings, what the model fixes, and every request's held cache."""

    settings: PluginSettings
    runner: object
    gates: dict[str, RetentionGates] = field(default_factory=dict)
    rotary: Rotary | None = None
    held: dict[str, HeldCache] = field(default_factory=dict)
    reads: dict[str, dict[int, ReadLayer]] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=dict)

    def plan(self, metadata: object, block_size: int, num_layers: int) -> StepPlan | None:
        """The step's rows (None for a step of no known requests: vLLM's warm-up)."""
        batch = self.runner.input_batch
        starts = metadata.query_start_loc_cpu.tolist()
        if len(batch.req_ids) < metadata.num_reqs:
            return None
        rows = []
        for i, req_id in enumerate(batch.req_ids[: metadata.num_reqs]):
            computed, prompt = int(batch.num_computed_tokens_cpu[i]), int(batch.num_prompt_tokens[i])
            if computed == 0:  # a new request, or one resumed after preemption: its cache starts over
                self.held[req_id] = HeldCache()
            held = self.held.setdefault(req_id, HeldCache())
            seen = computed + starts[i + 1] - starts[i]
            due = self._due(computed, seen, prompt, held)
            blocks = metadata.block_table_tensor[i]
            rows.append(RowPlan(req_id, starts[i], starts[i + 1], computed, seen, blocks, held.evicted, due))
        return StepPlan(tuple(rows), num_layers, block_size)

    def _due(self, computed: int, seen: int, prompt: int, held: HeldCache) -> bool:
        """Compact when the prompt's last chunk is in, and, holding a size, whenever `buffer` more came in.

        A request that has seen fewer tokens than the policy's window is kept whole (kvsieve.compress would refuse
        to score it).
        """
        if seen < self.settings.policy.needs.window:
            return False
        if computed < prompt <= seen:
            return True
        if not self.settings.bounded or computed < prompt:
            return False
        return seen - held.evicted >= self.settings.budget.max_tokens + self.settings.buffer

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.held.pop(req_id, None)

    def take_evictions(self) -> dict[str, int]:
        """`{request: entries evicted from its front}` for the requests compacted since the last call."""
        evictions, self.evictions = self.evictions, {}
        return evictions

    def after_attention(
        self,
        layer: torch.nn.Module,
        kv_cache_dtype: str,
        facts: LayerFacts,
        query: torch.Tensor,
        output: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: StepPlan,
    ) -> None:
        """Record what one layer's window queries yielded (`query`, `output`: `[tokens, q_heads * d]` of the step)
        and read its due requests' entries; after the last layer, compact."""
        needs = self.settings.policy.needs
        if not needs.window and not plan.due:
            return
        layer_idx = layer_index(layer.layer_name)
        for row in plan.rows:
            held = self.held[row.req_id]
            if needs.window:
                recent = held.recent.setdefault(layer_idx, RecentMeasures(needs.window))
                self._record(recent, row, facts.q_heads, query, output)
            if row.due:
                check_layout(layer, kv_cache_dtype, kv_cache)
                shifted = row.blocks[row.evicted // plan.block_size :]
                keys, values = read_entries(kv_cache, shifted, row.stored)
                positions = held.positions(layer_idx, keys.shape[0], row.stored)
                read = ReadLayer(layer, kv_cache_dtype, kv_cache, facts, keys, values, positions)
                self.reads.setdefault(row.req_id, {})[layer_idx] = read
        if plan.due and all(len(self.reads.get(row.req_id, ())) == plan.num_layers for row in plan.due):
            for row in plan.due:
                self._compact(row, plan, self.reads.pop(row.req_id))

    def _record(
        self, recent: RecentMeasures, row: RowPlan, q_heads: int, query: torch.Tensor, output: torch.Tensor
    ) -> None:
        """Keep what the row's last window queries yielded: every measure of `Needs.window_measures`."""
        start = max(row.start, row.stop - recent.window)
        ran = [x[start : row.stop].view(row.stop - start, q_heads, -1).transpose(0, 1)[None] for x in (query, output)]
        measures = self.settings.policy.needs.window_measures
        recent.append({m.name: m.measure(*ran)[0] for m in measures}, row.positions[start - row.start :])

    def observations(self, row: RowPlan, reads: dict[int, ReadLayer]) -> list[Observation]:
        """Every layer's observation of a due request, as `kvsieve.compress` builds it for its prompt."""
        held, num_layers = self.held[row.req_id], len(reads)
        seen = None if not held.evicted else row.seen
        out = []
        for layer_idx, read in sorted(reads.items()):
            stats = Statistics()
            recent = held.recent.get(layer_idx)
            if recent is not None:
                stats = Statistics(window=dict(recent.measured), window_positions=recent.positions)
            observation = Observation(
                layer_idx=layer_idx,
                num_layers=num_layers,
                keys=read.keys,
                values=read.values,
                positions=read.positions,
                valid=None,
                facts=read.facts,
                stats=stats,
                rotary=self.rotary,
                seen=seen,
                bounded=self.settings.bounded,
            )
            out.append(observation)
        return out

    def _compact(self, row: RowPlan, plan: StepPlan, reads: dict[int, ReadLayer]) -> None:
        """Select with the policy, write each layer's kept entries to the front of the request's blocks."""
        observations = self.observations(row, reads)
        keep = self.settings.policy.select(observations, self.settings.budget)
        counts = {int(index.numel()) for layer in keep for index in layer}
        if len(counts) != 1:
            raise RuntimeError(f"kvsieve kept different counts per (layer, kv-head) ({sorted(counts)}) in vLLM")
        count = counts.pop()
        if count == row.stored:
            return
        held, evicted = self.held[row.req_id], row.seen - count
        slots = plan.destination(row, evicted, count)
        for obs, kept in zip(observations, keep, strict=True):
            read, index = reads[obs.layer_idx], torch.stack(kept)  # [kv_heads, count]
            gather = index[..., None].expand(-1, -1, obs.keys.shape[-1])
            keys, values = obs.keys.gather(1, gather), obs.values.gather(1, gather)
            write_entries(
                read.layer, read.kv_cache_dtype, read.kv_cache, keys.transpose(0, 1), values.transpose(0, 1), slots
            )
            held.kept[obs.layer_idx] = obs.positions.gather(1, index)
        held.evicted = evicted
        self.evictions[row.req_id] = evicted


@functools.cache
def layer_index(layer_name: str) -> int:
    """The decoder layer of an attention layer named like ``model.layers.7.self_attn.attn``."""
    numbers = [int(part) for part in layer_name.split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise ValueError(f"kvsieve cannot tell the layer index of vLLM attention layer {layer_name!r}")
    return numbers[0]
