"""Eviction during generation: a cache held at a size budget while it grows.

A `BoundedGrowth` rides on a `SievedCache`. Before a forward appends new tokens, it checks every
sequence: if the entries would pass the budget plus `buffer` per (layer, kv-head) on average, the
policy scores what the cache holds (`cached_observations`) and the cache is evicted back to the
budget, every layer at once (the allocator splits the budget as after a prefill). So the cache
never holds more than `budget + buffer` entries per (layer, kv-head) on average, and eviction
runs once every `buffer` decoding steps. Cost per eviction: one scoring of every held entry and
one copy of the kept ones; between evictions, nothing.

Scorers run on what the cache holds plus the last queries (`RecentQueries`: the prefill's last
`window` queries, then every decoding query, kept per layer and row; one copy of the query per
layer and step), so scorers that read keys, values, positions and recent queries (`window`,
`snapkv`, `tova`, `streaming`, `random`, `knorm`, `keydiff`) serve during generation. Those that
read attention accumulated over all queries, the output projection or the rotary embedding do
not yet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .budget import SizeBudget, check_count
from .cache import SievedCache
from .errors import PolicyError
from .observe import Needs, Observation, Prefill, Statistics, cached_observations
from .policy import Policy

#: Tokens a bounded cache may grow past its budget before it is evicted back to it.
DEFAULT_BUFFER = 64


class RecentQueries:
    """The last `window` queries (after RoPE, float32) of every layer and row, and their cache positions."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.queries: dict[int, torch.Tensor] = {}  # layer -> [rows, q_heads, w, d]
        self.positions: dict[int, torch.Tensor] = {}  # layer -> [rows, w]

    def seed(self, prefill: Prefill) -> None:
        """Start from the last queries an observed prefill recorded (positions become cache positions)."""
        for column, observed in enumerate(prefill.observations[0]):
            layer = observed.layer_idx
            stats = [observations[column].stats for observations in prefill.observations]
            self.queries[layer] = torch.stack([s.window_queries for s in stats])
            self.positions[layer] = torch.stack(
                [
                    s.window_positions if entries is None else entries[s.window_positions]
                    for s, entries in zip(stats, prefill.entries, strict=True)
                ]
            )

    def append(self, layer_idx: int, query: torch.Tensor, positions: torch.Tensor) -> None:
        """Log a forward's queries `[rows, q_heads, q, d]` at cache positions `[q]`, keeping the last `window`."""
        rows = query.shape[0]
        if layer_idx not in self.queries:  # a cache that started empty
            self.queries[layer_idx] = query.new_empty(rows, query.shape[1], 0, query.shape[-1], dtype=torch.float32)
            self.positions[layer_idx] = positions.new_empty(rows, 0)
        held = self.queries[layer_idx]
        if rows != held.shape[0]:
            raise ValueError(
                f"the bounded cache logs queries of {held.shape[0]} sequence(s), got {query.shape[0]}; "
                "rows cannot be added or reordered (beam search, num_return_sequences) on a bounded cache"
            )
        self.queries[layer_idx] = torch.cat([held, query.detach().float()], dim=2)[:, :, -self.window :]
        self.positions[layer_idx] = torch.cat(
            [self.positions[layer_idx], positions.to(held.device).expand(rows, -1)], dim=1
        )[:, -self.window :]

    def statistics(self, layer_idx: int, row: int, base: Statistics) -> Statistics:
        """`base` with the layer's recent queries of `row`."""
        return dataclasses.replace(
            base, window_queries=self.queries[layer_idx][row], window_positions=self.positions[layer_idx][row]
        )


@dataclass(frozen=True)
class BoundedGrowth:
    """Keeps a cache at `budget` (plus at most `buffer` entries per (layer, kv-head) on average) while it grows.

    Attributes:
        policy: scores and allocates, as for the prefill.
        budget: the size (`MaxTokens` or `MaxBytes`) of every sequence.
        buffer: entries per (layer, kv-head) the cache grows past the budget before it is evicted.
        layers: each layer's `Statistics` (`kvsieve.observe.layer_statistics`).
        queries: the recent queries the policy's scorer reads (None if it reads none).
    """

    policy: Policy
    budget: SizeBudget
    buffer: int
    layers: Sequence[Statistics]
    queries: RecentQueries | None = None

    def __post_init__(self) -> None:
        check_count("buffer", self.buffer)
        needs = self.policy.needs
        if needs != Needs(window=needs.window):
            raise PolicyError(
                f"{self.policy.name} reads attention accumulated over all queries, the output projection or the "
                f"rotary embedding ({needs}), which eviction during generation does not record yet; bounded "
                "generation works with scorers that read the cache and recent queries (streaming, random, knorm, "
                "keydiff, window, snapkv, tova)"
            )

    @classmethod
    def of(cls, policy: Policy, budget: SizeBudget, buffer: int, layers: Sequence[Statistics]) -> BoundedGrowth:
        """A bounded growth that logs the recent queries the policy reads (`start` it from the prefill)."""
        window = policy.needs.window
        return cls(policy, budget, buffer, layers, RecentQueries(window) if window else None)

    def start(self, prefill: Prefill) -> None:
        """Take the recent queries from the prefill the cache was compressed from."""
        if self.queries is not None:
            self.queries.seed(prefill)

    def before_append(self, cache: SievedCache, incoming: int) -> None:
        """Evict every sequence back to the budget if appending `incoming` tokens would pass budget + buffer."""
        layers = [cache.layers[idx].segments for idx in cache.full_layers]
        if not layers or any(segments is None for segments in layers):
            return
        heads = sum(segments.heads for segments in layers)
        budget = self.budget.reserve(cache.window_nbytes())  # sliding-window layers' bytes come first
        limit = budget.tokens_per_head(heads, layers[0].entry_bytes()) + self.buffer
        if max(cache.mean_stored(row) for row in range(cache.batch_size)) + incoming <= limit:
            return
        self.evict(cache)

    def evict(self, cache: SievedCache) -> None:
        """Evict every sequence of `cache` back to the budget."""
        budget = self.budget.reserve(cache.window_nbytes())
        rows = range(cache.batch_size)
        cache.evict([self.policy.keep_indices(self.observations(cache, row), budget) for row in rows])

    def observations(self, cache: SievedCache, row: int) -> list[Observation]:
        """What the scorer reads for one sequence: the entries the cache holds and the recent queries."""
        layers = list(self.layers)
        if self.queries is not None:
            for idx in cache.full_layers:
                layers[idx] = self.queries.statistics(idx, row, layers[idx])
        return cached_observations(cache, layers, row)
