"""StreamingLLM: attention sinks plus the most recent tokens (arXiv 2309.17453)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..observation import Needs, Observation


@dataclass(frozen=True)
class StreamingScorer:
    """Later position = higher score; with the sinks protected this keeps sinks + the most recent entries."""

    name: ClassVar[str] = "streaming"
    calibrated: ClassVar[bool] = False
    needs: ClassVar[Needs] = Needs()

    def score(self, obs: Observation) -> torch.Tensor:
        return obs.positions.to(torch.float32)
