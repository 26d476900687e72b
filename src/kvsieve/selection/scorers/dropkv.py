"""DropKV: the squared change of each recent query's attention output when one entry is evicted.

Decoupled residual-output perturbation (OpenReview MqfNzH3TVH; kvpress PR 285). Removing entry `j`
renormalises query `i`'s softmax, moving its output by `p_ij / (1 - p_ij) (o_i - v_j)` (CAOTE's
`removal_effect`); the score sums the squared norm of that move over the last `window` queries. `o_i`
is the query's output over the entries the cache holds, which the runtime records and keeps valid after
evictions (`ATTENTION_OUTPUTS`, declared here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..observation import DEFAULT_WINDOW, Needs, Observation
from .base import check_window
from .caote import removal_effect


@dataclass(frozen=True)
class AttentionOutputs:
    """Each query's attention output per query head, before `W_o`, over the entries the cache holds (float32)."""

    name: str = "attention_outputs"
    reads_output: bool = True

    def measure(self, query: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        return output.detach().float()


ATTENTION_OUTPUTS = AttentionOutputs()


@dataclass(frozen=True)
class DropKVScorer:
    """`s_j = sum_i (p_ij / (1 - p_ij))^2 ||v_j - o_i||^2` over the last `window` queries, summed over the query
    heads of a group."""

    name: ClassVar[str] = "dropkv"
    calibrated: ClassVar[bool] = False
    window: int = DEFAULT_WINDOW

    def __post_init__(self) -> None:
        check_window(self.window)

    @property
    def needs(self) -> Needs:
        return Needs(window=self.window, measures=(ATTENTION_OUTPUTS,))

    def score(self, obs: Observation) -> torch.Tensor:
        outputs = obs.measured(ATTENTION_OUTPUTS, self.window)  # [q_heads, w, d]
        attention = obs.window_attention(self.window)  # [q_heads, w, n]
        values = obs.values.float().repeat_interleave(obs.group, dim=0)  # [q_heads, n, d]
        return obs.per_kv_head(removal_effect(attention, values, outputs).square().sum(dim=1))
