"""Entries of kv-heads that hold different counts, padded per head: what a compaction writes, what a step reads, and
kvsieve's attention over them (vLLM's kernel reads a request only while every lane holds its entries at home)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.attention import masked_sdpa, tallied_attention
from ..selection.merge import Merged
from ..selection.observation import LayerFacts, Observation, causal_attention

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


def compacted_entries(
    obs: Observation, keep: list[torch.Tensor], merged: Merged | None, shared: int = 0
) -> CompactedEntries:
    """The entries a layer keeps behind a shared prefix of `shared` positions (kept where they are): each head's
    `keep` indices of `obs` at positions from `shared` on, then its merged entries of finite bias."""
    heads, dim = obs.num_kv_heads, obs.keys.shape[-1]
    keep = [index[obs.positions[head, index] >= shared] for head, index in enumerate(keep)]
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
    tally: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One request's attention in one layer over its held entries: `query [n, q_heads, d]` (or `[n, q_heads * d]`)
    at true `query_positions [n]` -> `[n, q_heads, d]`, and with `tally` the attention each entry received from
    these queries, `[kv_heads, width, group]` (else None).

    An entry is visible to a query at or after its position (merged entries, at -1, to every query); a merged
    entry's logit is raised by its bias. The kernels are the runtime's (`kvsieve.kernels.attention`): a masked SDPA,
    or with `tally` the explicit float32 softmax that also sums each column.
    """
    n = query.shape[0]
    heads_query = query.reshape(n, facts.q_heads, -1).transpose(0, 1)[None]  # [1, q_heads, n, d]
    visible = entries.positions[:, None, :] <= query_positions[None, :, None]  # [kv_heads, n, width]
    if entries.valid is not None:
        visible &= entries.valid[:, None, :]
    keys, values = entries.keys[None], entries.values[None]
    if tally:
        if bias is not None:  # a merge summarizes one eviction: such a request is never scored again
            raise ValueError("kvsieve does not add up the attention merged entries receive")
        out, received = tallied_attention(heads_query, keys, values, visible[None], facts.scaling)
        return out[0], received[0]
    additive = torch.zeros(visible.shape, dtype=heads_query.dtype)
    if bias is not None:
        additive += bias[:, None, :].to(additive.dtype)
    additive.masked_fill_(~visible, float("-inf"))
    return masked_sdpa(heads_query, keys, values, additive[None], facts.scaling)[0], None


def window_outputs(
    obs: Observation, kept: list[torch.Tensor], queries: torch.Tensor, positions: torch.Tensor, facts: LayerFacts
) -> torch.Tensor:
    """`[q_heads, w, dv]` the attention outputs of the window `queries [q_heads, w, d]` at `positions [w]` over the
    entries `kept` of `obs` (per kv-head), each query seeing those at or before its position (float32)."""
    group = facts.q_heads // obs.num_kv_heads
    width = max(len(index) for index in kept)
    index = torch.stack([torch.nn.functional.pad(i, (0, width - len(i))) for i in kept])
    valid = torch.arange(width) < torch.tensor([len(i) for i in kept])[:, None]
    gathered = [
        t.gather(1, index[..., None].expand(-1, -1, t.shape[-1])).repeat_interleave(group, dim=0)
        for t in (obs.keys, obs.values)
    ]
    at = obs.positions.gather(1, index).repeat_interleave(group, dim=0)
    attention = causal_attention(queries, positions, gathered[0], at, facts.scaling, valid.repeat_interleave(group, 0))
    return attention @ gathered[1].float()
