"""Forced slots: a kvsieve policy's eviction with evidence spans forced in, at the same budget.

The fixed-contract diagnostic (arXiv 2605.08234) changes one decision at a time. A forced-slot
variant takes the entries a policy keeps in each (layer, kv-head), adds the evidence tokens a
`Forcing` rule names for that head, and makes room for them by dropping as many of the head's
kept, evictable (unprotected), non-evidence entries, lowest `swap_out` score first. Every head
therefore keeps exactly the entries it kept before; only which ones changes.

Forcing rules, per (layer, kv-head) and evidence span (a `[start, end)` token range):

- ``all``: every evidence token (the evidence-first oracle: force the evidence, fill by the scalar);
- ``evicted``: the tokens of every span the head evicted entirely (the mis-scoring check);
- ``partial``: the missing tokens of every span the head kept only in part (the coupling check).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from ...runtime.api.evictions import Eviction
from ...selection.merge import Merged
from ...selection.observation import Needs, Observation
from ...selection.policy import Policy
from ...selection.protection import protected_mask
from ...selection.scorers.base import Scorer
from .methods import FROM_PREFILL, CacheBuilder, Case, KvsievePolicy
from .streams import Stream

Forcing = Literal["all", "evicted", "partial"]
FORCINGS: tuple[str, ...] = ("all", "evicted", "partial")

#: What joins a policy's spec to its forcing in a forced variant's name: ``<policy>@force=<forcing>/<swap_out>``.
FORCE_MARK = "@force="

Spans = tuple[tuple[int, int], ...]


def forced_tokens(kept: torch.Tensor, spans: Spans, forcing: Forcing) -> torch.Tensor:
    """Token positions a rule forces into one head that keeps the positions `kept` (sorted LongTensor)."""
    out = []
    for start, end in spans:
        span = torch.arange(start, end, device=kept.device)
        held = torch.isin(span, kept)
        whole, none = bool(held.all()), not bool(held.any())
        if forcing == "all" or (forcing == "evicted" and none) or (forcing == "partial" and not whole and not none):
            out.append(span[~held])
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long, device=kept.device)


def swap_in(
    keep: torch.Tensor, positions: torch.Tensor, force: torch.Tensor, droppable: torch.Tensor, swap_out: torch.Tensor
) -> torch.Tensor:
    """One head's kept indices with the positions `force` swapped in for the lowest-`swap_out` droppable entries.

    Args:
        keep: sorted kept entry indices. positions: `[n]` token position of every entry.
        force: token positions to bring in (those already kept are ignored).
        droppable: `[n]` bool, entries that may make room (evictable and not evidence).
        swap_out: `[n]` scores; the lowest droppable kept entries leave first.
    Returns the sorted kept indices, as many as `keep` (fewer forced tokens come in if fewer may leave).
    """
    incoming = torch.isin(positions, force).nonzero().flatten()
    incoming = incoming[~torch.isin(incoming, keep)]
    candidates = keep[droppable[keep]]
    count = min(incoming.numel(), candidates.numel())
    if count == 0:
        return keep
    leaving = candidates[torch.topk(swap_out[candidates].float(), count, largest=False).indices]
    staying = keep[~torch.isin(keep, leaving)]
    return torch.cat([staying, incoming[:count]]).sort().values


@dataclass(frozen=True)
class ForcedEviction:
    """An `Eviction` whose kept set has evidence forced in by `forcing` (see the module doc); same size per head."""

    base: Eviction
    spans: Spans
    forcing: Forcing
    swap_out: Scorer

    def kept_entries(
        self, observations: Sequence[Observation], reserved: int = 0, entry_bytes: int | None = None
    ) -> list[list[torch.Tensor]]:
        policy = self.base.policy
        if not isinstance(policy, Policy):
            raise TypeError("forced slots need a resolved Policy")
        evidence = torch.tensor([p for s, e in self.spans for p in range(s, e)], dtype=torch.long)
        out = []
        base = self.base.kept_entries(observations, reserved, entry_bytes)
        for obs, per_head in zip(observations, base, strict=True):
            protected = protected_mask(obs, policy.n_sink, policy.n_recent, self.base.protect_positions)
            droppable = obs.valid_mask & ~protected & ~torch.isin(obs.positions, evidence.to(obs.positions.device))
            swap_out = self.swap_out.score(obs)
            layer = []
            for h, keep in enumerate(per_head):
                kept_positions = obs.positions[h, keep]
                force = forced_tokens(kept_positions, self.spans, self.forcing)
                layer.append(swap_in(keep, obs.positions[h], force, droppable[h], swap_out[h]))
            out.append(layer)
        return out

    def merged_entries(
        self, observations: Sequence[Observation], kept: Sequence[Sequence[torch.Tensor]]
    ) -> list[Merged] | None:
        return self.base.merged_entries(observations, kept)


@dataclass(frozen=True)
class ForcedSlots:
    """A kvsieve policy with the case's evidence spans forced in by `forcing`, making room by `swap_out`.

    Named ``<policy>@force=<forcing>/<swap_out>``; the case must carry its `evidence_spans`.
    """

    policy: Policy
    forcing: Forcing
    swap_out: Scorer
    library: ClassVar[str] = "kvsieve"
    builder: ClassVar[CacheBuilder] = FROM_PREFILL
    is_full: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.forcing not in FORCINGS:
            raise ValueError(f"unknown forcing {self.forcing!r}; known: {', '.join(FORCINGS)}")

    @property
    def name(self) -> str:
        return f"{self.policy.name}{FORCE_MARK}{self.forcing}/{self.swap_out.name}"

    @property
    def needs(self) -> Needs:
        return self.policy.needs | self.swap_out.needs

    @property
    def protected(self) -> int:
        return self.policy.n_sink + self.policy.n_recent

    def stream(self, model: torch.nn.Module, budget: int | None, buffer: int, seed: int) -> Stream:
        raise ValueError(f"{self.name}: forced slots need a case's evidence spans and do not run on streams")

    def eviction(self, case: Case, rate: float) -> ForcedEviction:
        base = KvsievePolicy(self.policy).eviction(case, rate)
        return ForcedEviction(base, case.evidence_spans, self.forcing, self.swap_out)
