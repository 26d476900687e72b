"""SnapKV: window attention pooled over neighbouring keys (arXiv 2404.14469)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..observation import DEFAULT_WINDOW, Needs, Observation
from .base import check_window


@dataclass(frozen=True)
class SnapKVScorer:
    """Mean attention from the last `window` queries, average-pooled over `kernel` neighbouring keys.

    Pooling keeps the neighbours of a strongly attended key, so evidence survives as phrases,
    not isolated tokens. Query heads of a group are averaged.
    """

    name: ClassVar[str] = "snapkv"
    calibrated: ClassVar[bool] = False
    window: int = DEFAULT_WINDOW
    kernel: int = 5

    def __post_init__(self) -> None:
        check_window(self.window)
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be an odd number >= 1, got {self.kernel}")

    @property
    def needs(self) -> Needs:
        return Needs(window=self.window)

    def score(self, obs: Observation) -> torch.Tensor:
        attention = obs.window_attention(self.window).mean(dim=1)  # [q_heads, n]
        pooled = F.avg_pool1d(attention[:, None], self.kernel, stride=1, padding=self.kernel // 2)[:, 0]
        return obs.per_kv_head(pooled) / obs.group
