"""Observations of what a (possibly evicted) cache holds: scorers re-score a ragged cache from them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from ...modeling.rotary import Rotary
from ...selection.observation import NOTHING_MEASURED, LayerFacts, Observation, Statistics
from ..storage.cache import SievedCache
from ..storage.segments import PAD_POSITION
from .facts import layer_facts


def cached_observations(
    cache: SievedCache,
    facts: Sequence[LayerFacts],
    row: int = 0,
    rotary: Rotary | None = None,
    recorded: Mapping[int, Statistics] | None = None,
    reconstructed: Mapping[int, torch.Tensor] | None = None,
    bounded: bool = False,
) -> list[Observation]:
    """Observations of the entries a (possibly evicted) cache holds for one sequence, one per full-attention layer.

    Every kv-head has its own entries, padded to the longest and marked by `valid`; `facts` gives every
    layer's `LayerFacts` (`layer_facts`), `recorded` per layer what its recent queries yielded. The attention
    each entry received is read from the cache when it keeps it (a bounded cache whose scorer
    accumulates). `reconstructed`: per layer, `[rows, q_heads, positions]` the most attention each cache
    position got while the model repeated its context (`kvsieve.runtime.observing.reconstruction.reconstruct`).
    `bounded`: the cache is held at a size as it grows (`Observation.bounded`). Nothing is recomputed: a scorer
    that reads what is neither given nor kept raises a clear error.
    """
    if len(facts) != len(cache.layers):
        raise ValueError(f"got the facts of {len(facts)} layers for a cache of {len(cache.layers)}")
    observations = []
    for idx in cache.full_layers:
        layer = cache.layers[idx]
        stats = NOTHING_MEASURED if recorded is None else recorded[idx]
        segments = layer.segments
        view = segments.padded()
        positions = view.slots.positions()[row]
        valid = positions != PAD_POSITION
        positions = positions.masked_fill(~valid, -1)
        if segments.received is not None:  # [heads, n, group] -> [q_heads, n]
            received = segments.padded_received()[row].permute(0, 2, 1).flatten(0, 1)
            stats = dataclasses.replace(stats, received=received)
        if reconstructed is not None:
            stats = dataclasses.replace(stats, reconstructed=_by_column(reconstructed[idx][row], positions, valid))
        observations.append(
            Observation(
                idx,
                len(cache.layers),
                view.keys[row],
                view.values[row],
                positions,
                valid,
                facts[idx],
                stats,
                rotary,
                seen=layer.seen_tokens,
                bounded=bounded,
            )
        )
    return observations


def observe_cache(model: torch.nn.Module, cache: SievedCache, row: int = 0) -> list[Observation]:
    """`cached_observations` of one sequence of `cache`, with the layer facts read from `model`."""
    return cached_observations(cache, layer_facts(model), row)


def _by_column(by_position: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`[q_heads, positions]` read at each kv-head's columns (`positions`, `valid`: `[kv_heads, columns]`):
    `[q_heads, columns]`, 0 in padding columns."""
    group = by_position.shape[0] // positions.shape[0]
    columns = positions.clamp(min=0).repeat_interleave(group, dim=0)
    return by_position.gather(1, columns).masked_fill(~valid.repeat_interleave(group, dim=0), 0.0)
