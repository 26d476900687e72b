"""CriticalKV: attention times the projected value norm, from an output-perturbation view (arXiv 2502.03805)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..observation import DEFAULT_WINDOW, Needs, Observation
from .base import check_window

#: Entries projected at once (a few MiB of projections, so the norms are taken in cache).
ROWS_PER_BLOCK = 512


def projected_value_norms(values: torch.Tensor, output_weight: torch.Tensor, group: int) -> torch.Tensor:
    """`||W_o^h v||_1` for every query head h and entry: `[q_heads, n]`.

    Args:
        values: `[kv_heads, n, d]`; output_weight: `[hidden, q_heads * d]`.
    """
    kv_heads, n, dim = values.shape
    norms = []
    for h in range(kv_heads):
        # the group's slices of W_o side by side, [d, group * hidden]; rows in blocks that stay in cache
        slices = output_weight[:, h * group * dim : (h + 1) * group * dim].float()
        stacked = slices.unflatten(1, (group, dim)).permute(2, 1, 0).reshape(dim, -1).contiguous()
        blocks = [
            (values[h, start : start + ROWS_PER_BLOCK].float() @ stacked).unflatten(1, (group, -1)).abs().sum(dim=-1)
            for start in range(0, n, ROWS_PER_BLOCK)
        ]
        norms.append(torch.cat(blocks).t())
    return torch.cat(norms)


@dataclass(frozen=True)
class CriticalScorer:
    """Mean attention of the last `window` queries times `||W_o^h v||_1`, summed over the group.

    The entry's contribution to the layer output goes through the head's slice of the output
    projection; this bounds the output perturbation of evicting it. (The paper's two-stage
    selection, attention first then this score, is folded into one ranking.)
    """

    name: ClassVar[str] = "critical"
    calibrated: ClassVar[bool] = False
    window: int = DEFAULT_WINDOW

    def __post_init__(self) -> None:
        check_window(self.window)

    @property
    def needs(self) -> Needs:
        return Needs(window=self.window, output_projection=True)

    def score(self, obs: Observation) -> torch.Tensor:
        weight = obs.facts.output_weight
        if weight is None:
            raise ValueError("critical needs the attention output projection (Needs.output_projection)")
        attention = obs.window_attention(self.window).mean(dim=1)  # [q_heads, n]
        return obs.per_kv_head(attention * projected_value_norms(obs.values, weight, obs.group))
