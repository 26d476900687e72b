"""Attention from the last queries of the context (the observation window of SnapKV, arXiv 2404.14469)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..observe import DEFAULT_WINDOW, Observation, causal_attention


@dataclass(frozen=True)
class WindowScorer:
    """Mean attention each key received from the last `window` queries, summed over its query-head group.

    `keykey=True` uses the last `window` keys as stand-in queries instead (one per kv-head,
    causal inside the window): cheap, and it needs no query states.
    """

    name: ClassVar[str] = "window"
    needs_accumulated: ClassVar[bool] = False
    window: int = DEFAULT_WINDOW
    keykey: bool = False

    def score(self, obs: Observation) -> torch.Tensor:
        if not self.keykey:
            return obs.per_kv_head(obs.window_attention(self.window).mean(dim=1))
        keys = obs.keys
        stand_ins, stand_in_positions = keys[:, -self.window :], obs.positions[-self.window :]
        return causal_attention(stand_ins, stand_in_positions, keys, obs.positions, obs.scaling).mean(dim=1)
