"""Expected Attention: the attention future queries are expected to pay, times the value norm (arXiv 2510.00636)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ...modeling.rotary import unrotate
from ..observation import DEFAULT_WINDOW, Needs, Observation
from .base import check_window


def mean_rotation(cos: torch.Tensor, sin: torch.Tensor, head_dim: int | None = None) -> torch.Tensor:
    """`[d, d]` average of the RoPE matrices `diag(cos) + diag(sin) P` over the given positions (`cos, sin [f, r]`).

    With partial rotary embeddings (`r < head_dim`), the coordinates past `r` are not rotated (identity).
    """
    dim = cos.shape[-1]
    half = torch.eye(dim // 2, dtype=cos.dtype, device=cos.device)
    partner = torch.zeros(dim, dim, dtype=cos.dtype, device=cos.device)
    partner[: dim // 2, dim // 2 :] = -half
    partner[dim // 2 :, : dim // 2] = half
    rotation = torch.diag(cos.mean(0)) + torch.diag(sin.mean(0)) @ partner
    rest = (head_dim or dim) - dim
    return torch.block_diag(rotation, torch.eye(rest, dtype=cos.dtype, device=cos.device)) if rest else rotation


def expected_logits(keys: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """`log E[exp(s q.k)]` for `q ~ N(mean, cov)`: `s mean.k + s^2 k^T cov k / 2`, shape `[heads, n]`.

    Args:
        keys: `[heads, n, d]`; mean: `[heads, d]`; cov: `[heads, d, d]` or None (mean only).
    """
    logits = scaling * (keys @ mean[..., None])[..., 0]
    if cov is not None:
        logits = logits + 0.5 * scaling**2 * torch.einsum("hnd,hde,hne->hn", keys, cov, keys)
    return logits


@dataclass(frozen=True)
class ExpectedScorer:
    """Expected attention of the next `future` queries, modelled as a Gaussian of the last `window` queries.

    The recorded queries are un-rotated (pre-RoPE), their mean and covariance are rotated by
    the average RoPE matrix of the next `future` positions, and each key gets the softmax of
    `log E[exp(s q.k)]` over the context, averaged over the query group, times the L2 norm of
    its value (`vnorm`).
    """

    name: ClassVar[str] = "expected"
    calibrated: ClassVar[bool] = False
    window: int = DEFAULT_WINDOW
    future: int = 512
    covariance: bool = True
    vnorm: bool = True

    def __post_init__(self) -> None:
        check_window(self.window)
        if self.future < 1:
            raise ValueError(f"future must be >= 1, got {self.future}")

    @property
    def needs(self) -> Needs:
        return Needs(window=self.window, rotary=True)

    def score(self, obs: Observation) -> torch.Tensor:
        if obs.rotary is None:
            raise ValueError("expected needs the model's rotary embedding (Needs.rotary)")
        queries, positions = obs.queries(self.window)
        pre_rope = unrotate(queries, *obs.rotary(positions))
        mean = pre_rope.mean(dim=1)
        future = torch.arange(1, self.future + 1, device=positions.device) + positions[-1]
        rotation = mean_rotation(*obs.rotary(future), head_dim=queries.shape[-1])
        cov = None
        if self.covariance:
            centered = pre_rope - mean[:, None]
            cov = rotation @ (centered.transpose(1, 2) @ centered / pre_rope.shape[1]) @ rotation.T
        keys = obs.keys.float().repeat_interleave(obs.group, dim=0)
        logits = expected_logits(keys, mean @ rotation.T, cov, obs.scaling)
        if obs.valid is not None:
            logits = logits.masked_fill(~obs.valid.repeat_interleave(obs.group, dim=0), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        scores = obs.per_kv_head(probs) / obs.group
        return scores * obs.values.float().norm(dim=-1) if self.vnorm else scores
