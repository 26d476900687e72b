"""CAOTE: the change of the attention output caused by removing one entry (arXiv 2504.14051)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..observation import DEFAULT_WINDOW, Needs, Observation
from .base import check_window


def removal_effect(attention: torch.Tensor, values: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """`||o - o_without_j|| = a_j / (1 - a_j) * ||v_j - o||` for every query and entry.

    Args:
        attention: `[heads, q, n]`; values: `[heads, n, d]`; output: `[heads, q, d]`.
    Returns: `[heads, q, n]`.
    """
    distance = torch.cdist(values, output).transpose(1, 2)  # [heads, q, n]
    return attention / (1.0 - attention).clamp(min=1e-6) * distance


@dataclass(frozen=True)
class CAOTEScorer:
    """Mean over the last `window` queries of the closed-form output change when the entry is evicted.

    Removing entry j renormalises the softmax, so the output moves by `a_j/(1-a_j) (o - v_j)`.
    Summed over the query heads of a group.
    """

    name: ClassVar[str] = "caote"
    calibrated: ClassVar[bool] = False
    window: int = DEFAULT_WINDOW

    def __post_init__(self) -> None:
        check_window(self.window)

    @property
    def needs(self) -> Needs:
        return Needs(window=self.window)

    def score(self, obs: Observation) -> torch.Tensor:
        attention = obs.window_attention(self.window)  # [q_heads, w, n]
        values = obs.values.float().repeat_interleave(obs.group, dim=0)  # [q_heads, n, d]
        output = attention @ values
        return obs.per_kv_head(removal_effect(attention, values, output).mean(dim=1))
