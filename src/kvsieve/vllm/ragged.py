"""Entries of kv-heads that hold different counts, padded per head: what a compaction writes, what a step reads, and
kvsieve's attention over them (vLLM's kernel reads a request only while every lane holds its entries at home)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.attention import masked_sdpa
from ..selection.merge import Merged
from ..selection.observation import LayerFacts, Observation

#: The position of a merged entry and of padding.
NO_POSITION = -1


@dataclass(frozen=True)
class HeldEntries:
    """One layer's entries of one request as its cells hold them: `keys`, `values [kv_heads, width, d]`,
    `positions [kv_heads, width]` (-1 for merged entries and padding), `valid [kv_heads, width]` (None: all)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor | None


@dataclass(frozen=True)
class CompactedEntries:
    """What one layer keeps after a compaction, per kv-head its kept entries and then its merged ones, padded.

    Attributes:
        keys, values: `[kv_heads, width, d]`.
        positions: `[kv_heads, width]` (-1 for merged entries and padding).
        bias: `[kv_heads, width]` logit biases (0 for kept entries), or None when nothing was merged.
        counts: entries per kv-head.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    bias: torch.Tensor | None
    counts: list[int]


def compacted_entries(obs: Observation, keep: list[torch.Tensor], merged: Merged | None) -> CompactedEntries:
    """The entries a layer keeps: each head's `keep` indices of `obs`, then its merged entries of finite bias."""
    heads, dim = obs.num_kv_heads, obs.keys.shape[-1]
    parts = [] if merged is None else [torch.isfinite(merged.bias[head]).nonzero().flatten() for head in range(heads)]
    counts = [len(keep[head]) + (len(parts[head]) if parts else 0) for head in range(heads)]
    width = max(counts)
    keys, values = obs.keys.new_zeros(heads, width, dim), obs.values.new_zeros(heads, width, dim)
    positions = torch.full((heads, width), NO_POSITION, dtype=torch.long)
    bias = None if merged is None else torch.full((heads, width), float("-inf"))
    for head, index in enumerate(keep):
        kept = len(index)
        keys[head, :kept], values[head, :kept] = obs.keys[head, index], obs.values[head, index]
        positions[head, :kept] = obs.positions[head, index]
        if merged is not None:
            part = parts[head]
            keys[head, kept : counts[head]] = merged.keys[head, part].to(keys.dtype)
            values[head, kept : counts[head]] = merged.values[head, part].to(values.dtype)
            bias[head, :kept] = 0.0
            bias[head, kept : counts[head]] = merged.bias[head, part]
    return CompactedEntries(keys, values, positions, bias, counts)


def ragged_attention(
    query: torch.Tensor,
    entries: HeldEntries,
    bias: torch.Tensor | None,
    query_positions: torch.Tensor,
    facts: LayerFacts,
) -> torch.Tensor:
    """One request's attention in one layer over its held entries: `query [n, q_heads, d]` (or `[n, q_heads * d]`)
    at true `query_positions [n]` -> `[n, q_heads, d]`.

    An entry is visible to a query at or after its position (merged entries, at -1, to every query); a merged
    entry's logit is raised by its bias. The kernel is the runtime's (`kvsieve.kernels.attention.masked_sdpa`).
    """
    n = query.shape[0]
    heads_query = query.reshape(n, facts.q_heads, -1).transpose(0, 1)[None]  # [1, q_heads, n, d]
    visible = entries.positions[:, None, :] <= query_positions[None, :, None]  # [kv_heads, n, width]
    if entries.valid is not None:
        visible &= entries.valid[:, None, :]
    additive = torch.zeros(visible.shape, dtype=heads_query.dtype)
    if bias is not None:
        additive += bias[:, None, :].to(additive.dtype)
    additive.masked_fill_(~visible, float("-inf"))
    out = masked_sdpa(heads_query, entries.keys[None], entries.values[None], additive[None], facts.scaling)
    return out[0]
