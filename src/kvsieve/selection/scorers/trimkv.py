"""TrimKV: learned retention `(t - i) * log beta_i` (arXiv 2512.03324; one scale: DBTrimKV, arXiv 2605.09649)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...modeling.gates import RetentionGates, checked_horizon, retention_scores
from ...modeling.rotary import unrotate
from ..checkpoint import DEFAULT_GATES
from ..observation import Needs, Observation

#: `horizon=default`: the horizon the gates' checkpoint records for the eviction at hand (`Horizons`; 0, the next
#: step, where it records none).
DEFAULT_HORIZON = "default"


@dataclass(frozen=True)
class TrimKVScorer:
    """Each entry's retention `horizon` tokens ahead, from learned retention gates (`kvsieve train-gates`).

    `gates` is a checkpoint folder, or ``"default"`` for the one kvsieve ships for the model. The
    gates read each entry's key (RoPE undone) and value; every layer and head shares one scoring
    projection, so scores compare across layers and heads: the `global` allocator takes them raw.

    `horizon` is how many tokens after the last one the retentions `beta^(t - i)` are compared: 0 is
    TrimKV's own next step, which favours recent entries; further ahead, an entry that decays slowly
    outranks a recent one that decays fast, and ``inf`` ranks by `log beta` alone. ``"default"`` takes
    the horizon the gates' checkpoint records (`Horizons`): one for compressing a prompt once, one for a
    cache evicted again as it grows (`Observation.bounded`); each shipped checkpoint records the ones its
    ablation chose.
    """

    name: ClassVar[str] = "trimkv"
    calibrated: ClassVar[bool] = True
    gates: str = DEFAULT_GATES
    horizon: float | str = DEFAULT_HORIZON

    def __post_init__(self) -> None:
        if self.horizon == DEFAULT_HORIZON:
            return
        try:
            object.__setattr__(self, "horizon", checked_horizon(self.horizon))
        except ValueError as err:
            raise ValueError(f"{err} (or default: the horizon the checkpoint records)") from None

    @property
    def needs(self) -> Needs:
        return Needs(rotary=True, gates=(self.gates,))

    def score(self, obs: Observation) -> torch.Tensor:
        gates = obs.facts.gates.get(self.gates)
        if obs.rotary is None or gates is None:
            raise ValueError(f"trimkv needs the rotary embedding and the gates {self.gates!r} (Needs.rotary, .gates)")
        log_beta = entry_log_beta(gates, obs)
        horizon = gates.horizons.at(obs.bounded) if self.horizon == DEFAULT_HORIZON else self.horizon
        if math.isinf(horizon):
            return log_beta
        now = obs.seen if obs.seen is not None else int(obs.positions.max()) + 1
        return retention_scores(log_beta, obs.positions, now + horizon)


def entry_log_beta(gates: RetentionGates, obs: Observation) -> torch.Tensor:
    """`[kv_heads, n]` `log beta` of every observed entry: the gates read its key (RoPE undone) and value."""
    positions = obs.positions.clamp(min=0)
    cos, sin = obs.rotary(positions.flatten())
    keys = unrotate(obs.keys.float(), *(x.view(*positions.shape, -1) for x in (cos, sin)))
    return gates.log_beta(obs.layer_idx, keys, obs.values.float())
