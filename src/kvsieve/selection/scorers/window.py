"""Attention from the last queries of the context (the observation window of SnapKV, arXiv 2404.14469)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..observation import DEFAULT_WINDOW, Needs, Observation, causal_attention
from .base import check_window


@dataclass(frozen=True)
class WindowScorer:
    """Mean attention each key received from the last `window` queries, summed over its query-head group.

    `keykey=True` uses each head's last `window` keys as stand-in queries instead (causal inside
    the window): cheap, and it needs no query states.
    """

    name: ClassVar[str] = "window"
    calibrated: ClassVar[bool] = False
    window: int = DEFAULT_WINDOW
    keykey: bool = False

    def __post_init__(self) -> None:
        check_window(self.window)

    @property
    def needs(self) -> Needs:
        return Needs() if self.keykey else Needs(window=self.window)

    def score(self, obs: Observation) -> torch.Tensor:
        if not self.keykey:
            return obs.per_kv_head(obs.window_attention(self.window).mean(dim=1))
        window = min(self.window, obs.length)
        last = obs.valid_mask.sum(dim=-1, keepdim=True)  # each head's entries are left-aligned
        stand_in = (last - window + torch.arange(window, device=last.device)).clamp(min=0)  # [kv, w]
        keys = obs.keys.gather(1, stand_in[..., None].expand(-1, -1, obs.keys.shape[-1]))
        positions = obs.positions.gather(1, stand_in)
        return causal_attention(keys, positions, obs.keys, obs.positions, obs.scaling, obs.valid).mean(dim=1)
