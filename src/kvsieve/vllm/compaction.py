"""The worker's side of the plugin: plan each step, attend what vLLM's kernel cannot, record what the policy reads,
score with `kvsieve.selection`, compact.

Scoring reads exactly what `kvsieve.compress` reads, built from vLLM's own cache: every layer's keys and values,
their positions, what the last window queries yielded and, where the scorer reads it, the attention every entry
received; `Policy.select` decides over all layers at once (the allocator and the budget see the whole request).
The kept entries of every (layer, kv-head) are packed into the request's cells behind its shared prefix
(`kvsieve.vllm.cells`); the blocks behind them are reported to the scheduler, which gives them back to vLLM's pool.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ..modeling.gates import RetentionGates
from ..modeling.rotary import Rotary
from ..selection.budget import MaxTokens
from ..selection.observation import QUERIES, LayerFacts, Needs, Observation, Statistics
from .adapter import CacheLayout
from .cells import LayerCells, after_prefix, pack_cells
from .held import CompactedLayer, HeldCache, RecentMeasures
from .plan import RowPlan, StepPlan
from .ragged import CompactedEntries, HeldEntries, compacted_entries, ragged_attention, window_outputs
from .settings import PluginSettings


@dataclass
class ReadLayer:
    """One layer's entries of one due request, read after the step's attention, and what the model fixes of it."""

    facts: LayerFacts
    entries: HeldEntries


@dataclass
class WorkerSieve:
    """One worker's plugin state: the settings, what the model fixes, every layer's cache and every request's held
    cache."""

    settings: PluginSettings
    runner: object
    layout: CacheLayout  # the backend's cache, cell by cell (`kvsieve.vllm.adapter`)
    gates: dict[str, RetentionGates] = field(default_factory=dict)
    rotary: Rotary | None = None
    needs: Needs = field(default_factory=Needs)
    output_weights: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> W_o, when a scorer reads it
    caches: dict[int, torch.Tensor] = field(default_factory=dict)
    held: dict[str, HeldCache] = field(default_factory=dict)
    shared: dict[str, int] = field(default_factory=dict)  # request -> shared prefix, from this step's scheduler
    reads: dict[str, dict[int, ReadLayer]] = field(default_factory=dict)
    evictions: dict[str, tuple[int, float]] = field(default_factory=dict)

    def plan(self, metadata: object, block_size: int, num_layers: int) -> StepPlan | None:
        """The step's rows (None for a step of no known requests: vLLM's warm-up)."""
        batch = self.runner.input_batch
        starts = metadata.query_start_loc_cpu.tolist()
        if len(batch.req_ids) < metadata.num_reqs:
            return None
        rows = []
        for i, req_id in enumerate(batch.req_ids[: metadata.num_reqs]):
            computed, prompt = int(batch.num_computed_tokens_cpu[i]), int(batch.num_prompt_tokens[i])
            seen = computed + starts[i + 1] - starts[i]
            held = self.held.get(req_id)
            if computed == 0 or held is None:  # a new request, or one resumed after preemption: it starts over
                held = self.held[req_id] = HeldCache(chunked=seen < prompt and self.settings.chunk_policy is not None)
            if not held.compacted:  # fixed at the first compaction
                held.shared = self.shared.get(req_id, 0)
            row = RowPlan(
                req_id,
                starts[i],
                starts[i + 1],
                computed,
                seen,
                prompt,
                blocks=metadata.block_table_tensor[i],
                evicted=held.evicted,
                due=self._due(computed, seen, prompt, held),
                ragged=held.ragged,
                shared=held.shared,
                tally=self.needs.accumulated and (self.settings.bounded or computed < prompt or not held.compacted),
            )
            rows.append(row)
        return StepPlan(tuple(rows), num_layers, block_size)

    def _due(self, computed: int, seen: int, prompt: int, held: HeldCache) -> bool:
        """Compact when the prompt's last chunk is in; a prompt prefilled in chunks also after any chunk that would
        let the next one take it past its size plus a chunk (as `compress(..., chunk=)` evicts before such a
        chunk); holding a size, whenever `buffer` more came in.

        A request that has seen fewer tokens than the policy's window is kept whole (kvsieve.compress would refuse
        to score it).
        """
        if seen < self.needs.window:
            return False
        if computed < prompt <= seen:
            return True
        stored = held.mean_stored(seen - held.evicted)
        if computed < prompt:
            chunk = seen - computed
            size = self.settings.prompt_size(prompt, held.shared)
            return held.chunked and stored + min(chunk, prompt - seen) > size + chunk
        return self.settings.bounded and stored >= self.settings.budget.max_tokens + self.settings.buffer

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.held.pop(req_id, None)

    def take_evictions(self) -> dict[str, tuple[int, float]]:
        """`{request: (entries evicted behind its shared prefix, entries per lane on average)}` for the requests
        compacted since the last call."""
        evictions, self.evictions = self.evictions, {}
        return evictions

    def attend(
        self, layer_idx: int, facts: LayerFacts, query: torch.Tensor, output: torch.Tensor, plan: StepPlan
    ) -> None:
        """Write into `output` the attention of every row of the step that kvsieve attends itself: a ragged one (vLLM's
        kernel cannot read its cells) and one whose entries' received attention the policy reads (tallied)."""
        for row in plan.rows:
            if row.attended:
                held, entries = self.held[row.req_id], self._entries(layer_idx, row, plan)
                bias = held.bias(layer_idx, entries.keys.shape[0], row.stored)
                attended, received = ragged_attention(
                    query[row.start : row.stop], entries, bias, row.positions, facts, tally=row.tally
                )
                output[row.start : row.stop] = attended.reshape(output[row.start : row.stop].shape)
                if received is not None:
                    held.add_received(layer_idx, entries, received)

    def after_attention(
        self, layer_idx: int, facts: LayerFacts, query: torch.Tensor, output: torch.Tensor, plan: StepPlan
    ) -> None:
        """Record what one layer's window queries yielded (`query`, `output`: `[tokens, q_heads * d]` of the step)
        and read its due requests' entries; after the last layer, compact."""
        needs = self.needs
        if not needs.window and not plan.due:
            return
        for row in plan.rows:
            held = self.held[row.req_id]
            if needs.window:
                recent = held.recent.setdefault(layer_idx, RecentMeasures(needs.window))
                self._record(recent, row, facts.q_heads, query, output)
            if row.due:
                read = ReadLayer(facts, self._entries(layer_idx, row, plan))
                self.reads.setdefault(row.req_id, {})[layer_idx] = read
        if plan.due and all(len(self.reads.get(row.req_id, ())) == plan.num_layers for row in plan.due):
            for row in plan.due:
                self._compact(row, plan, self.reads.pop(row.req_id))

    def _entries(self, layer_idx: int, row: RowPlan, plan: StepPlan) -> HeldEntries:
        """A row's entries in one layer after the step's cache write, padded per kv-head."""
        held, kv_heads = self.held[row.req_id], self.caches[layer_idx].shape[1]
        cells = held.cells(layer_idx, kv_heads, row.stored)
        keys, values = self.layout.read(self.caches, plan.blocks_after(row, row.evicted), cells)
        valid = cells.valid
        return HeldEntries(
            keys, values, held.positions(layer_idx, kv_heads, row.stored), None if bool(valid.all()) else valid
        )

    def _record(
        self, recent: RecentMeasures, row: RowPlan, q_heads: int, query: torch.Tensor, output: torch.Tensor
    ) -> None:
        """Keep what the row's last window queries yielded: every measure of `Needs.window_measures`."""
        start = max(row.start, row.stop - recent.window)
        ran = [x[start : row.stop].view(row.stop - start, q_heads, -1).transpose(0, 1)[None] for x in (query, output)]
        measures = self.needs.window_measures
        recent.append({m.name: m.measure(*ran)[0] for m in measures}, row.positions[start - row.start :])

    def observations(self, row: RowPlan, reads: dict[int, ReadLayer]) -> list[Observation]:
        """Every layer's observation of a due request, as `kvsieve.compress` builds it for its prompt."""
        held, num_layers = self.held[row.req_id], len(reads)
        seen = None if not held.evicted else row.seen
        out = []
        for layer_idx, read in sorted(reads.items()):
            entries = read.entries
            recent = held.recent.get(layer_idx)
            window = {} if recent is None else dict(recent.measured)
            stats = Statistics(
                window=window,
                window_positions=None if recent is None else recent.positions,
                received=held.received_at(layer_idx, entries) if self.needs.accumulated else None,
            )
            observation = Observation(
                layer_idx=layer_idx,
                num_layers=num_layers,
                keys=entries.keys,
                values=entries.values,
                positions=entries.positions,
                valid=entries.valid,
                facts=read.facts,
                stats=stats,
                rotary=self.rotary,
                seen=seen,
                bounded=self.settings.bounded or held.chunked,
            )
            out.append(observation)
        return out

    def _compact(self, row: RowPlan, plan: StepPlan, reads: dict[int, ReadLayer]) -> None:
        """Select with the policy (merging what it evicts, where it merges; the shared prefix protected), pack every
        (layer, kv-head)'s entries behind that prefix into the request's cells (`kvsieve.vllm.cells`), write them."""
        observations = self.observations(row, reads)
        held = self.held[row.req_id]
        policy, budget = self.settings.policy, self.settings.budget
        if held.chunked:  # as compress(..., chunk=) holds the prompt at its size: evicting again, no merge
            policy, budget = self.settings.chunk_policy, MaxTokens(self.settings.prompt_size(row.prompt, held.shared))
        protect = torch.arange(held.shared) if held.shared else None
        keep = policy.select(observations, budget, protect_positions=protect)
        merged = policy.merged(observations, keep)
        layers = [
            compacted_entries(obs, kept, None if merged is None else merged[i], held.shared)
            for i, (obs, kept) in enumerate(zip(observations, keep, strict=True))
        ]
        packing = pack_cells([layer.counts for layer in layers], start=held.shared)
        if packing.identity and merged is None and held.shared + packing.rows == row.stored:
            return
        evicted = row.seen - held.shared - packing.rows
        blocks = plan.blocks_after(row, evicted)
        for obs, layer, cells in zip(observations, layers, packing.layers, strict=True):
            self.layout.write(self.caches, blocks, cells, layer.keys, layer.values)
            held.compacted[obs.layer_idx] = compacted_layer(obs.layer_idx, cells, layer, held.shared)
        held.evicted, held.rows = evicted, held.shared + packing.rows
        lanes = sum(len(layer.counts) for layer in layers)
        held.mean = held.shared + sum(sum(layer.counts) for layer in layers) / lanes
        held.ragged = not packing.identity or merged is not None
        self.evictions[row.req_id] = (evicted, held.mean)
        self._refresh(held, observations, keep, reads)

    def _refresh(
        self,
        held: HeldCache,
        observations: list[Observation],
        keep: list[list[torch.Tensor]],
        reads: dict[int, ReadLayer],
    ) -> None:
        """Measure again what reads the attention output, on each window query's output over the entries kept."""
        stale = [measure for measure in self.needs.measures if measure.reads_output]
        for obs, kept in zip(observations, keep, strict=True) if stale else ():
            recent = held.recent[obs.layer_idx]
            queries = recent.measured[QUERIES.name]
            outputs = window_outputs(obs, kept, queries, recent.positions, reads[obs.layer_idx].facts)
            for measure in stale:
                recent.measured[measure.name] = measure.measure(queries[None], outputs[None])[0]


def compacted_layer(layer_idx: int, cells: LayerCells, entries: CompactedEntries, shared: int) -> CompactedLayer:
    """What a request holds of a layer after a compaction: its shared prefix where it is, then its packed entries."""
    if not shared:
        return CompactedLayer(cells, entries.positions, entries.bias)
    heads = entries.positions.shape[0]
    positions = torch.cat([torch.arange(shared).expand(heads, -1), entries.positions], dim=1)
    bias = None if entries.bias is None else torch.cat([torch.zeros(heads, shared), entries.bias], dim=1)
    return CompactedLayer(after_prefix(cells, layer_idx, shared), positions, bias)


@functools.cache
def layer_index(layer_name: str) -> int:
    """The decoder layer of an attention layer named like ``model.layers.7.self_attn.attn``."""
    numbers = [int(part) for part in layer_name.split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise ValueError(f"kvsieve cannot tell the layer index of vLLM attention layer {layer_name!r}")
    return numbers[0]
