"""Attention from the last queries of the context (the observation window of SnapKV, arXiv 2404.14469)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..observe import DEFAULT_WINDOW, Observation


@dataclass(frozen=True)
class WindowScorer:
    """Attention each key received from the last `window` queries, summed over its query-head group."""

    name: ClassVar[str] = "window"
    window: int = DEFAULT_WINDOW

    def score(self, obs: Observation) -> torch.Tensor:
        if obs.window != self.window:
            raise ValueError(
                f"window={self.window} needs a prefill observed with window {self.window}, got {obs.window}"
            )
        return obs.per_kv_head(obs.received_window)
