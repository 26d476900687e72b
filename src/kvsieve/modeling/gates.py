"""Retention gates: a learned decay rate for every cache entry (TRIM-KV, arXiv 2512.03324; DBTrimKV, arXiv 2605.09649).

Each (layer, kv-head) has a small hidden layer that reads the entry's own key (RoPE undone) and
value (each at unit RMS, plus the log of their RMS); one scoring projection, the same parameters
for every layer and head (DBTrimKV's shared final projection), turns that into `log beta` in
(-inf, 0] through a log-sigmoid. At time `t` the
entry written at position `i` scores `(t - i) * log beta`: it decays at its own rate, and because
every layer and head ends in the same projection, the scores of all of them sit on one axis and one
global top-k can compare them. A checkpoint also records its `Horizons`: how many tokens after the last
one a scorer compares the retentions by default, `(t + horizon - i) * log beta` (0: TrimKV's next step),
one for compressing a prompt once and one for a cache evicted again and again as it grows.

TRIM-KV's gate reads the layer's normalised hidden state when the entry is written, and its cache
stores `beta`. Ours reads the entry itself (`W_k x` with RoPE undone, and `W_v x`, for that head),
so `beta` can be recomputed from any cache, after any eviction, with nothing stored beside it; and
no model layer has to be hooked to see its hidden state.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from .architecture import kv_geometry, layer_windows
from .errors import UnhookableModelError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: Initial bias of the scoring projection: `log sigmoid(6) = -0.0025`, so every entry starts almost fully kept.
DEFAULT_BIAS_INIT = 6.0
#: Hidden units per (layer, kv-head).
DEFAULT_WIDTH = 32


@dataclass(frozen=True)
class GateShape:
    """The dimensions that tie a set of gates to a model.

    Attributes:
        layers: model indices of the layers that have gates (the full-attention ones).
        kv_heads, head_dim: of those layers.
        width: hidden units per (layer, kv-head).
    """

    layers: tuple[int, ...]
    kv_heads: int
    head_dim: int
    width: int = DEFAULT_WIDTH

    def to_dict(self) -> dict:
        return asdict(self) | {"layers": list(self.layers)}

    @classmethod
    def from_dict(cls, data: dict) -> GateShape:
        return cls(tuple(data["layers"]), data["kv_heads"], data["head_dim"], data["width"])


def gate_shape(model: PreTrainedModel, width: int = DEFAULT_WIDTH) -> GateShape:
    """The gates `model` needs: one per kv-head of each full-attention layer (sliding layers keep their window)."""
    full = tuple(i for i, window in enumerate(layer_windows(model)) if window is None)
    if not full:
        raise UnhookableModelError(
            f"{type(model).__name__} has no full-attention layer: every layer keeps its own sliding window, which "
            "no policy evicts, so there is nothing for retention gates to score"
        )
    return GateShape(full, *kv_geometry(model), width)


def checked_horizon(horizon: float | str) -> float:
    """A scoring horizon as a number of tokens (>= 0, or ``inf``), or a ValueError that says what it must be."""
    try:
        value = float(horizon)
    except (TypeError, ValueError):
        value = math.nan
    if not value >= 0:  # NaN too
        raise ValueError(f"horizon must be a number of tokens >= 0 or inf, got {horizon!r}")
    return value


@dataclass(frozen=True)
class Horizons:
    """How many tokens ahead a scorer compares the gates' retentions unless told otherwise (kept in the checkpoint).

    Attributes:
        once: when a prompt is compressed once (`kvsieve.compress`): the kept entries serve whatever comes later.
        bounded: when a cache is held at a size while it grows and is evicted again every few tokens (None:
            as `once`). Far ahead, an entry's score never falls with age and stale entries pile up.
    """

    once: float = 0.0
    bounded: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "once", checked_horizon(self.once))
        try:
            bounded = self.once if self.bounded is None else checked_horizon(self.bounded)
        except ValueError as err:
            raise ValueError(f"bounded {err}") from None
        object.__setattr__(self, "bounded", bounded)

    def at(self, bounded: bool) -> float:
        """The horizon for one compression (`bounded=False`) or for a bounded cache's evictions."""
        return self.bounded if bounded else self.once


#: TrimKV's next step, for one compression and a bounded cache alike (a checkpoint that records no horizon).
NEXT_STEP = Horizons()


class RetentionGates(nn.Module):
    """`log beta` of each entry of each gated layer: per-(layer, head) hidden layers, one shared scoring projection.

    `horizons` are the ones a scorer reads these gates at unless told otherwise, `projection` (a
    `kvsieve.selection.projection` projection, or None: topk) the one a policy reading them picks with
    when it names none, and `merge` (a `kvsieve.selection.merge` merge, or None) the one it folds what each
    head evicts with when it names none; all are kept in the checkpoint.
    """

    def __init__(
        self,
        shape: GateShape,
        bias_init: float = DEFAULT_BIAS_INIT,
        horizons: Horizons = NEXT_STEP,
        projection: object | None = None,
        merge: object | None = None,
    ) -> None:
        super().__init__()
        self.shape = shape
        self.horizons = horizons
        self.projection = projection
        self.merge = merge
        features = 2 * shape.head_dim + 2
        self.hidden_weight = nn.ParameterDict(
            {str(layer): nn.Parameter(torch.empty(shape.kv_heads, features, shape.width)) for layer in shape.layers}
        )
        self.hidden_bias = nn.ParameterDict(
            {str(layer): nn.Parameter(torch.zeros(shape.kv_heads, shape.width)) for layer in shape.layers}
        )
        self.scoring = nn.Linear(shape.width, 1)
        for weight in self.hidden_weight.values():
            nn.init.normal_(weight, std=features**-0.5)
        nn.init.normal_(self.scoring.weight, std=0.02)
        nn.init.constant_(self.scoring.bias, bias_init)

    def log_beta(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """`[..., kv_heads, n]` log retention of entries: pre-RoPE `keys`, `values` `[..., kv_heads, n, head_dim]`."""
        name = str(layer_idx)
        if name not in self.hidden_weight:
            raise ValueError(f"layer {layer_idx} has no retention gate; gated layers: {list(self.shape.layers)}")
        if keys.shape[-3:] != (self.shape.kv_heads, keys.shape[-2], self.shape.head_dim):
            raise ValueError(
                f"retention gates expect {self.shape.kv_heads} kv-heads of dimension {self.shape.head_dim}, "
                f"got keys of shape {tuple(keys.shape)}"
            )
        features = entry_features(keys.to(self.scoring.weight.dtype), values.to(self.scoring.weight.dtype))
        hidden = torch.einsum("...hnf,hfw->...hnw", features, self.hidden_weight[name])
        hidden = F.silu(hidden + self.hidden_bias[name][:, None])
        return F.logsigmoid(self.scoring(hidden)[..., 0])


def entry_features(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`[..., 2 head_dim + 2]` what a gate reads of each entry: key and value at unit RMS, and their log RMS."""
    rms = [x.pow(2).mean(-1, keepdim=True).add(1e-12).sqrt() for x in (keys, values)]
    return torch.cat([keys / rms[0], values / rms[1], rms[0].log(), rms[1].log()], dim=-1)


def retention_scores(log_beta: torch.Tensor, positions: torch.Tensor, now: float) -> torch.Tensor:
    """Geometric retention at time `now`: `(now - position) * log beta` (<= 0; higher = keep)."""
    return (now - positions).to(log_beta.dtype) * log_beta
