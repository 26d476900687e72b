"""Key-norm eviction: low key norm correlates with high attention (arXiv 2406.11430)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..observation import Needs, Observation


@dataclass(frozen=True)
class KnormScorer:
    """Score = minus the L2 norm of the key (RoPE is a rotation, so the norm is position-free)."""

    name: ClassVar[str] = "knorm"
    calibrated: ClassVar[bool] = False
    needs: ClassVar[Needs] = Needs()

    def score(self, obs: Observation) -> torch.Tensor:
        return -obs.keys.float().norm(dim=-1)
