"""TrimKV: learned retention `(t - i) * log beta_i` (arXiv 2512.03324; one scale: DBTrimKV, arXiv 2605.09649)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...modeling.gates import RetentionGates, retention_scores
from ...modeling.rotary import unrotate
from ..checkpoint import DEFAULT_GATES
from ..observation import Needs, Observation


@dataclass(frozen=True)
class TrimKVScorer:
    """Each entry's retention at the next step, from learned retention gates (`kvsieve train-gates`).

    `gates` is a checkpoint folder, or ``"default"`` for the one kvsieve ships for the model. The
    gates read each entry's key (RoPE undone) and value; every layer and head shares one scoring
    projection, so scores compare across layers and heads: the `global` allocator takes them raw.

    `horizon` is how many tokens after the last one the retentions `beta^(t - i)` are compared: 0 is
    TrimKV's own next step, which favours recent entries; further ahead, an entry that decays slowly
    outranks a recent one that decays fast, and ``inf`` ranks by `log beta` alone.
    """

    name: ClassVar[str] = "trimkv"
    calibrated: ClassVar[bool] = True
    gates: str = DEFAULT_GATES
    horizon: float = 0.0

    def __post_init__(self) -> None:
        if not self.horizon >= 0:  # NaN too
            raise ValueError(f"horizon must be a number of tokens >= 0 or inf, got {self.horizon}")

    @property
    def needs(self) -> Needs:
        return Needs(rotary=True, gates=(self.gates,))

    def score(self, obs: Observation) -> torch.Tensor:
        gates = obs.facts.gates.get(self.gates)
        if obs.rotary is None or gates is None:
            raise ValueError(f"trimkv needs the rotary embedding and the gates {self.gates!r} (Needs.rotary, .gates)")
        log_beta = entry_log_beta(gates, obs)
        if math.isinf(self.horizon):
            return log_beta
        now = obs.seen if obs.seen is not None else int(obs.positions.max()) + 1
        return retention_scores(log_beta, obs.positions, now + self.horizon)


def entry_log_beta(gates: RetentionGates, obs: Observation) -> torch.Tensor:
    """`[kv_heads, n]` `log beta` of every observed entry: the gates read its key (RoPE undone) and value."""
    positions = obs.positions.clamp(min=0)
    cos, sin = obs.rotary(positions.flatten())
    keys = unrotate(obs.keys.float(), *(x.view(*positions.shape, -1) for x in (cos, sin)))
    return gates.log_beta(obs.layer_idx, keys, obs.values.float())
