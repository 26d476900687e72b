"""H2O: heavy hitters (accumulated attention) plus recent tokens (arXiv 2306.14048)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..observation import Needs, Observation


@dataclass(frozen=True)
class H2OScorer:
    """Raw attention sum over all prefill queries, with the most recent `recent` share of the context on top.

    H2O splits its budget between heavy hitters and recent tokens. A scorer does not know the
    budget, so the recent share is a fraction of the context: those entries outrank every
    heavy hitter (newest first); the rest are ranked by accumulated attention. The policy's
    protected window comes on top of this.
    """

    name: ClassVar[str] = "h2o"
    calibrated: ClassVar[bool] = False
    needs: ClassVar[Needs] = Needs(accumulated=True)
    recent: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.recent <= 1.0:
            raise ValueError(f"recent must be a fraction in [0, 1], got {self.recent}")

    def score(self, obs: Observation) -> torch.Tensor:
        mass = obs.per_kv_head(obs.received(self.name))
        n_recent = round(self.recent * obs.length)
        if n_recent == 0:
            return mass
        positions = obs.positions.to(mass.dtype)
        boost = mass.max() + 1.0 + positions / obs.length
        is_recent = obs.positions >= obs.positions.max(dim=-1, keepdim=True).values + 1 - n_recent
        return torch.where(is_recent, boost, mass)
