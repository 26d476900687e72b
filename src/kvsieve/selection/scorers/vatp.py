"""VATP: value-aware token pruning, attention times value norm (arXiv 2406.12335)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..observation import Needs, Observation
from .importance import mean_received


@dataclass(frozen=True)
class VATPScorer:
    """Mean attention per seeing query (as `importance`) times the L1 norm of the value.

    An entry matters through what it adds to the output: attention mass alone ignores values
    with a tiny norm (often the attention sinks' values).
    """

    name: ClassVar[str] = "vatp"
    calibrated: ClassVar[bool] = False
    needs: ClassVar[Needs] = Needs(accumulated=True)

    def score(self, obs: Observation) -> torch.Tensor:
        return mean_received(obs, self.name) * obs.values.float().abs().sum(dim=-1)
