"""Random eviction: the baseline every policy must beat."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..observe import Observation


@dataclass(frozen=True)
class RandomScorer:
    """Seeded uniform scores, drawn independently for every (layer, kv-head, entry)."""

    name: ClassVar[str] = "random"
    needs_accumulated: ClassVar[bool] = False
    seed: int = 0

    def score(self, obs: Observation) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + obs.layer_idx)
        scores = torch.rand(obs.num_kv_heads, obs.length, generator=generator)
        return scores.to(obs.positions.device)
