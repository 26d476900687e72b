"""Accumulated attention mass (H2O's heavy-hitter statistic, arXiv 2306.14048)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..observation import Needs, Observation


def mean_received(obs: Observation, who: str) -> torch.Tensor:
    """`[kv_heads, n]` attention each key received per prefill query that could see it, summed over the group."""
    mass = obs.per_kv_head(obs.received(who))
    return mass / obs.queries_seeing().to(mass.dtype)


@dataclass(frozen=True)
class ImportanceScorer:
    """Attention each key received from all prefill queries, summed over its query-head group.

    A key at position t of a causal prefill of length T is seen by only T - t queries, so raw
    sums favour early tokens. We divide by that count: the score is the mean attention the
    key received per query that could see it (`normalize=False` gives H2O's raw sum).
    """

    name: ClassVar[str] = "importance"
    calibrated: ClassVar[bool] = False
    needs: ClassVar[Needs] = Needs(accumulated=True)
    normalize: bool = True

    def score(self, obs: Observation) -> torch.Tensor:
        if self.normalize:
            return mean_received(obs, self.name)
        return obs.per_kv_head(obs.received(self.name))
