"""Where a budget goes: entries kept per (layer, kv-head) under a policy's allocator, beside the uniform split.

One prompt is compressed twice at the same rate, by the same scorer and protection: once with the
policy's own allocator (for `trimkv+global`, one top-k over every entry of the model) and once with
`uniform` (every (layer, kv-head) keeps the same share). Both keep the same number of entries in
all; the first shows which layers and heads earned them. Sliding-window layers, which keep their
own window whatever the budget, are left out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ...runtime.api.compress import compress
from ...runtime.storage.cache import SievedCache
from ...selection.allocators import Uniform
from ...selection.spec import make_policy


@dataclass(frozen=True)
class Allocation:
    """Entries kept per (full-attention layer, kv-head) of one prompt, by the policy and by the uniform split."""

    policy: str
    rate: float
    tokens: int
    layers: list[int]
    kept: list[list[int]]  # [layer][kv-head], the policy's allocator
    uniform: list[list[int]]  # [layer][kv-head], the uniform split

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def layer_totals(self) -> tuple[list[int], list[int]]:
        """Entries kept per layer (summed over its kv-heads): by the policy, and by the uniform split."""
        return [sum(heads) for heads in self.kept], [sum(heads) for heads in self.uniform]

    def layer_shares(self) -> list[float]:
        """Entries kept per layer as a multiple of what the uniform split keeps there."""
        kept, uniform = self.layer_totals()
        return [mine / max(even, 1) for mine, even in zip(kept, uniform, strict=True)]


def _kept(cache: SievedCache, layers: list[int]) -> list[list[int]]:
    lengths = cache.stored_lengths()
    return [list(lengths[layer]) for layer in layers]


@torch.no_grad()
def budget_allocation(model: torch.nn.Module, input_ids: torch.Tensor, policy: str, rate: float) -> Allocation:
    """Compress `input_ids` (`[1, tokens]`) by `policy` and by its uniform twin at `rate`; entries kept per head."""
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"budget_allocation reads one prompt [1, tokens], got shape {tuple(input_ids.shape)}")
    resolved = make_policy(policy)
    input_ids = input_ids.to(model.device)
    cache = compress(model, input_ids, resolved, rate)
    uniform = compress(model, input_ids, dataclasses.replace(resolved, allocator=Uniform()), rate)
    layers = cache.full_layers
    return Allocation(policy, rate, input_ids.shape[1], layers, _kept(cache, layers), _kept(uniform, layers))
