"""Eviction during generation: a cache held at a size budget while it grows.

A `BoundedGrowth` rides on a `SievedCache`. Before a forward appends new tokens, it checks every
sequence: if the entries would pass the budget plus `buffer` per (layer, kv-head) on average, the
policy scores what the cache holds (`cached_observations`) and the cache is evicted back to the
budget, every layer at once (the allocator splits the budget as after a prefill). So the cache
never holds more than `budget + buffer` entries per (layer, kv-head) on average, and eviction
runs once every `buffer` decoding steps. Cost per eviction: one scoring of every held entry and
one copy of the kept ones; between evictions, nothing.

Scorers run on what the cache holds plus what they declared (`Needs`), kept up to date at a cost
per step and layer only when asked for:
- recent queries (`RecentWindow`: the prefill's last `window` queries, then every later query,
  per layer and row): one copy of the query (`window`, `snapkv`, `tova`, `caote`, `critical`, `expected`),
  and of whatever else a scorer declared each query yields (`Needs.measures`: `dropkv`'s attention outputs);
- attention accumulated online (`h2o`, `importance`, `vatp`): every query adds the attention it paid
  to every stored entry to that entry's sums (`Segments.received`, one float per entry and query
  head, seeded from the prefill and evicted with the entry). Sieve attention then computes the
  layer's attention with an explicit softmax instead of fused SDPA, and adds its column sums;
- the output projection (`critical`) and the rotary embedding (`expected`): read from the model,
  nothing per step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ...modeling.rotary import Rotary, find_rotary
from ...selection.budget import SizeBudget, check_count
from ...selection.errors import PolicyError
from ...selection.observation import QUERIES, LayerFacts, Observation, QueryMeasure, Statistics, causal_attention
from ...selection.policy import Policy
from ...selection.projection import MISSING_SPANS
from ..observing.cache_observations import cached_observations
from ..observing.facts import layer_facts
from ..observing.prefill import Prefill
from ..storage.cache import SievedCache
from ..storage.segments import PAD_POSITION, PaddedView

#: Tokens a bounded cache may grow past its budget before it is evicted back to it.
DEFAULT_BUFFER = 64


class RecentWindow:
    """What the last `window` queries of every layer and row yielded (`Needs.window_measures`: the queries, after
    RoPE, and any declared measure), and their cache positions."""

    def __init__(self, window: int, measures: Sequence[QueryMeasure]) -> None:
        self.window = window
        self.measures = tuple(measures)
        self.held: dict[int, dict[str, torch.Tensor]] = {}  # layer -> name -> [rows, q_heads, w, k]
        self.positions: dict[int, torch.Tensor] = {}  # layer -> [rows, w]

    @property
    def queries(self) -> dict[int, torch.Tensor]:
        """Per layer, the recent queries `[rows, q_heads, w, d]`."""
        return {layer: held[QUERIES.name] for layer, held in self.held.items()}

    def seed(self, prefill: Prefill) -> None:
        """Start from what an observed prefill recorded of its last queries (positions become cache positions)."""
        for column, observed in enumerate(prefill.observations[0]):
            stats = [observations[column].stats for observations in prefill.observations]
            self.held[observed.layer_idx] = {
                m.name: torch.stack([s.window[m.name] for s in stats]) for m in self.measures
            }
            self.positions[observed.layer_idx] = torch.stack(
                [
                    s.window_positions if entries is None else entries[s.window_positions]
                    for s, entries in zip(stats, prefill.entries, strict=True)
                ]
            )

    def append(self, layer_idx: int, query: torch.Tensor, output: torch.Tensor, positions: torch.Tensor) -> None:
        """Log a forward's measures of `query [rows, q_heads, q, d]` and `output` at cache positions `[q]`, keeping
        the last `window`."""
        rows = query.shape[0]
        measured = {m.name: m.measure(query, output) for m in self.measures}
        if layer_idx not in self.held:  # a cache that started empty
            self.held[layer_idx] = {name: value[:, :, :0] for name, value in measured.items()}
            self.positions[layer_idx] = positions.new_empty(rows, 0)
        held = self.held[layer_idx]
        if rows != self.positions[layer_idx].shape[0]:
            raise ValueError(
                f"the bounded cache logs queries of {self.positions[layer_idx].shape[0]} sequence(s), got {rows}; "
                "rows cannot be added or reordered (beam search, num_return_sequences) on a bounded cache"
            )
        self.held[layer_idx] = {
            name: torch.cat([held[name], value], dim=2)[:, :, -self.window :] for name, value in measured.items()
        }
        self.positions[layer_idx] = torch.cat(
            [self.positions[layer_idx], positions.to(self.positions[layer_idx].device).expand(rows, -1)], dim=1
        )[:, -self.window :]

    def refresh(self, cache: SievedCache, facts: Sequence[LayerFacts]) -> None:
        """Measure again what reads the attention output, on each window query's output over the entries `cache`
        holds now (after an eviction)."""
        stale = [m for m in self.measures if m.reads_output]
        for idx, held in self.held.items() if stale else ():
            queries = held[QUERIES.name]
            output = window_outputs(queries, self.positions[idx], cache.layers[idx].segments.padded(), facts[idx])
            for measure in stale:
                held[measure.name] = measure.measure(queries, output)

    def statistics(self, layer_idx: int, row: int) -> Statistics:
        """What the layer's recent queries of `row` yielded."""
        window = {name: value[row] for name, value in self.held[layer_idx].items()}
        return Statistics(window=window, window_positions=self.positions[layer_idx][row])


def window_outputs(queries: torch.Tensor, positions: torch.Tensor, view: PaddedView, facts: LayerFacts) -> torch.Tensor:
    """`[rows, q_heads, w, dv]` the attention outputs of `queries [rows, q_heads, w, d]` at cache `positions
    [rows, w]` over the entries of `view`, each query seeing those at or before its position (float32)."""
    entry_positions, group = view.slots.positions(), queries.shape[1] // view.keys.shape[1]
    outputs = []
    for row in range(queries.shape[0]):
        keys, values, at = (t[row].repeat_interleave(group, dim=0) for t in (view.keys, view.values, entry_positions))
        attention = causal_attention(queries[row], positions[row], keys, at, facts.scaling, at != PAD_POSITION)
        outputs.append(attention @ values.float())
    return torch.stack(outputs)


@dataclass(frozen=True)
class BoundedGrowth:
    """Keeps a cache at `budget` (plus at most `buffer` entries per (layer, kv-head) on average) while it grows.

    Attributes:
        policy: scores and allocates, as for the prefill.
        budget: the size (`MaxTokens` or `MaxBytes`) of every sequence.
        buffer: entries per (layer, kv-head) the cache grows past the budget before it is evicted.
        facts: each layer's `LayerFacts` (`kvsieve.runtime.observing.facts.layer_facts`).
        queries: what the recent queries yielded that the policy's scorer reads (None if it reads none).
        rotary: the model's rotary embedding, if the scorer reads it.
        protect: cache positions never evicted (a question), besides the policy's sinks and window.
        spans: per sequence, the span id of every cache position (``projection=sentence``; positions
            past them, such as generated tokens, are spans of their own).
    """

    policy: Policy
    budget: SizeBudget
    buffer: int
    facts: Sequence[LayerFacts]
    queries: RecentWindow | None = None
    rotary: Rotary | None = None
    protect: torch.Tensor | None = None
    spans: Sequence[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        check_count("buffer", self.buffer)
        if self.policy.needs_spans and self.spans is None:
            raise PolicyError(MISSING_SPANS)

    @property
    def accumulates(self) -> bool:
        """Whether the cache sums the attention every entry receives (the scorer reads it)."""
        return self.policy.needs.accumulated

    @classmethod
    def of(
        cls,
        policy: Policy,
        budget: SizeBudget,
        buffer: int,
        model: torch.nn.Module,
        protect: torch.Tensor | None = None,
        spans: Sequence[torch.Tensor] | None = None,
    ) -> BoundedGrowth:
        """A bounded growth that keeps what the policy's scorer reads (`start` it from a prefill, if any)."""
        policy = policy.evicting_again()
        needs = policy.needs
        queries = RecentWindow(needs.window, needs.window_measures) if needs.window else None
        rotary = find_rotary(model) if needs.rotary else None
        spans = None if spans is None else tuple(spans)
        return cls(policy, budget, buffer, layer_facts(model, needs), queries, rotary, protect, spans)

    def start(self, prefill: Prefill) -> None:
        """Take the recent queries' measures and the attention sums from the prefill the cache is compressed from.

        Call it before the prefill's cache is evicted: the sums then move with the kept entries.
        """
        if self.queries is not None:
            self.queries.seed(prefill)
        if self.accumulates:
            seed_received(prefill)

    def before_append(self, cache: SievedCache, incoming: int) -> None:
        """Evict every sequence back to the budget if appending `incoming` tokens would pass budget + buffer."""
        if self.overflows(cache, incoming):
            self.evict(cache)

    def overflows(self, cache: SievedCache, incoming: int) -> bool:
        """Whether appending `incoming` tokens would take a sequence of `cache` past budget + buffer."""
        layers = [cache.layers[idx].segments for idx in cache.full_layers]
        if not layers or any(segments is None for segments in layers):
            return False
        heads = sum(segments.heads for segments in layers)
        budget = self.budget.reserve(cache.reserved_nbytes())  # windows and full-precision residuals come first
        limit = budget.tokens_per_head(heads, layers[0].entry_bytes()) + self.buffer
        return max(cache.mean_stored(row) for row in range(cache.batch_size)) + incoming > limit

    def evict(self, cache: SievedCache, reconstructed: Mapping[int, torch.Tensor] | None = None) -> None:
        """Evict every sequence of `cache` back to the budget (`reconstructed`: as for `cached_observations`)."""
        budget = self.budget.reserve(cache.reserved_nbytes())  # windows and full-precision residuals come first
        stored = cache.layers[cache.full_layers[0]].entry_bytes()  # as the cache stores them (quantized: fewer)
        keep = []
        for row in range(cache.batch_size):
            spans = None if self.spans is None else self.spans[row]
            observations = self.observations(cache, row, reconstructed)
            keep.append(self.policy.select(observations, budget, self.protect, spans, stored))
        cache.evict(keep)
        self.evicted(cache)

    def evicted(self, cache: SievedCache) -> None:
        """Keep what the scorer reads valid for the entries `cache` holds after an eviction."""
        if self.queries is not None:
            self.queries.refresh(cache, self.facts)

    def observations(
        self, cache: SievedCache, row: int, reconstructed: Mapping[int, torch.Tensor] | None = None
    ) -> list[Observation]:
        """What the scorer reads for one sequence: the entries the cache holds and the recent queries' measures."""
        recorded = None
        if self.queries is not None:
            recorded = {idx: self.queries.statistics(idx, row) for idx in cache.full_layers}
        return cached_observations(cache, self.facts, row, self.rotary, recorded, reconstructed, bounded=True)


def seed_received(prefill: Prefill) -> None:
    """Store the attention every prefill entry received (`Statistics.received`) in the prefill's cache.

    Only full-attention layers are observed (`cache.full_layers`, in order). Padding entries get 0.
    From then on the sums move and are evicted with their entries.
    """
    for position, idx in enumerate(prefill.cache.full_layers):
        segments = prefill.cache.layers[idx].segments
        per_row = []
        for row, observations in enumerate(prefill.observations):
            received = observations[position].received("the bounded cache")  # [q_heads, n_real]
            received = received.unflatten(0, (segments.heads, -1)).transpose(1, 2)  # [heads, n_real, group]
            entries = prefill.entries[row]
            if entries is not None:
                full = received.new_zeros(segments.heads, segments.max_length, received.shape[-1])
                received = full.index_copy_(1, entries, received)
            per_row.append(received)
        segments.add_received(torch.stack(per_row))
