"""Many evictions of one observed prefill, as the rows of one cache ("prefill once, sieve many")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch

from ...selection.budget import Budget, as_budget
from ...selection.merge import Merged
from ...selection.observation import Observation
from ...selection.policy import Policy
from ...selection.spec import make_policy
from ..observing.prefill import Prefill
from ..storage.cache import SievedCache
from ..storage.codecs import FULL_PRECISION, EntryCodec, residual_nbytes, stored_entry_bytes


@dataclass(frozen=True)
class Eviction:
    """One eviction of a prefill: a policy (None: keep everything), a budget (a rate, or `kvsieve.MaxTokens` /
    `kvsieve.MaxBytes`), positions never to evict and the sequence's spans (`[n_tokens]`, a span id
    per token position, for ``projection=sentence``; see `Policy.select`)."""

    policy: str | Policy | None
    budget: float | Budget = 0.0
    protect_positions: torch.Tensor | None = None
    spans: torch.Tensor | None = None

    @cached_property
    def parsed_policy(self) -> Policy | None:
        """`policy` as a `Policy`, parsed once (None keeps everything)."""
        return None if self.policy is None else make_policy(self.policy)

    def kept_entries(
        self, observations: Sequence[Observation], reserved: int = 0, entry_bytes: int | None = None
    ) -> list[list[torch.Tensor]]:
        """Per observed layer and kv-head, the entries to keep. `reserved`: bytes per sequence of the
        sliding-window layers at their window, which a byte budget sets aside first; `entry_bytes`: the
        bytes an entry will be stored in (`Policy.select`)."""
        if self.parsed_policy is None:
            return [[torch.arange(o.length) for _ in range(o.num_kv_heads)] for o in observations]
        budget = as_budget(self.budget).reserve(reserved)
        return self.parsed_policy.select(observations, budget, self.protect_positions, self.spans, entry_bytes)

    def merged_entries(
        self, observations: Sequence[Observation], kept: Sequence[Sequence[torch.Tensor]]
    ) -> list[Merged] | None:
        """Per observed layer, what the heads evicted (all that `kept` does not name) merged, if the policy merges."""
        return None if self.parsed_policy is None else self.parsed_policy.merged(observations, kept)


class EvictionPlan(Protocol):
    """Anything that says which observed entries of one sequence to keep (`Eviction`, or a variant of one)."""

    def kept_entries(
        self, observations: Sequence[Observation], reserved: int = 0, entry_bytes: int | None = None
    ) -> list[list[torch.Tensor]]: ...

    def merged_entries(
        self, observations: Sequence[Observation], kept: Sequence[Sequence[torch.Tensor]]
    ) -> list[Merged] | None: ...


def evictions(
    prefill: Prefill, plans: Sequence[EvictionPlan], row: int = 0, codec: EntryCodec = FULL_PRECISION
) -> SievedCache:
    """One cache whose row `i` is sequence `row` of `prefill` evicted by `plans[i]`, its entries stored by `codec`.

    "Prefill once, sieve many" in one batch: a sweep decodes every (policy, rate) of a sample in
    one batched pass. The prefill's own cache is left as it is.
    """
    observations = prefill.observations[row]
    reserved = prefill.cache.window_nbytes() + residual_nbytes(codec, observations)
    stored = stored_entry_bytes(codec, observations)
    keep, merged = [], []
    for plan in plans:
        kept = plan.kept_entries(observations, reserved, stored)
        keep.append(prefill.stored(row, kept))
        merged.append(plan.merged_entries(observations, kept))
    cache = prefill.cache.keep(keep, rows=[row] * len(keep), codec=codec)
    cache.merge(merged)
    return cache
