"""TOVA: token omission via attention of the last query (arXiv 2401.06104)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..observation import Needs, Observation


@dataclass(frozen=True)
class TOVAScorer:
    """Attention of the last query, averaged over all query heads of the layer.

    TOVA ranks tokens per layer, not per head: every kv-head gets the same scores.
    """

    name: ClassVar[str] = "tova"
    calibrated: ClassVar[bool] = False
    needs: ClassVar[Needs] = Needs(window=1)

    def score(self, obs: Observation) -> torch.Tensor:
        last = obs.window_attention(1)[:, 0]  # [q_heads, n]
        return last.mean(dim=0).expand(obs.num_kv_heads, -1).contiguous()
