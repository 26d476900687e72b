"""Random eviction: the baseline every policy must beat."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..observation import Needs, Observation


@dataclass(frozen=True)
class RandomScorer:
    """Seeded uniform scores, drawn independently for every (layer, kv-head, position).

    An entry's score depends on its position, not on where it sits in the observation, so
    re-scoring an evicted (padded, ragged) cache gives every surviving entry its old score.
    """

    name: ClassVar[str] = "random"
    calibrated: ClassVar[bool] = False
    needs: ClassVar[Needs] = Needs()
    seed: int = 0

    def score(self, obs: Observation) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + obs.layer_idx)
        positions = obs.positions.clamp(min=0).cpu()
        table = torch.rand(obs.num_kv_heads, int(positions.max()) + 1, generator=generator)
        return table.gather(1, positions).to(obs.keys.device)
