"""Training losses for retention gates: distillation from the full cache, next-token, and the capacity hinge.

Formulas as in TRIM-KV (arXiv 2512.03324) and DBTrimKV (arXiv 2605.09649) and their public code:
the quality term is the forward KL from the full-cache teacher's next-token distribution (optionally
averaged with the next-token loss); the capacity term penalises the expected number of entries kept,
`S_t = sum_{i <= t} beta_i^(t - i)`, above the capacity `M`, normalised by how far above `M` the
sequence itself is: `max(0, (S_t - M) / max(t - M, 1))`, averaged over the positive terms. The global
variant sums `S_t` over every (layer, kv-head) and compares it with `M` times their number.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.nn import functional as F

from .retention import retention_bias

#: Where the capacity `M` applies: to the sum over every (layer, kv-head) (DBTrimKV), or to each head (TRIM-KV).
SCOPES = ("global", "head")


def forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of `KL(teacher || student)` of the next-token distributions (`[..., vocab]` logits)."""
    teacher = F.log_softmax(teacher_logits.float(), dim=-1)
    student = F.log_softmax(student_logits.float(), dim=-1)
    return (teacher.exp() * (teacher - student)).sum(-1).mean()


def next_token_loss(
    logits: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Cross-entropy of the token after each position (`logits [b, P, vocab]` at `positions`, every one if None).

    `input_ids [b, T]`; the last position of the sequence predicts nothing and is left out.
    """
    positions = torch.arange(input_ids.shape[1], device=logits.device) if positions is None else positions
    scored = positions < input_ids.shape[1] - 1
    targets = input_ids[:, positions[scored].to(input_ids.device) + 1]
    return F.cross_entropy(
        logits[:, scored.to(logits.device)].flatten(0, 1).float(), targets.flatten().to(logits.device)
    )


def expected_kept(log_beta: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """`[..., P]` `S_t = sum_{i <= t} beta_i^(t - i)`: the entries a soft cache holds after step `t`, at `positions`
    (every position if None)."""
    return retention_bias(log_beta, positions).exp().sum(-1)


def capacity_loss(
    log_betas: Iterable[torch.Tensor], capacity: int, scope: str = "global", positions: torch.Tensor | None = None
) -> torch.Tensor:
    """The capacity hinge over every gated layer's `log beta [batch, kv_heads, T]`, at `positions` (default: all).

    Args:
        capacity: `M`, entries per (layer, kv-head).
        scope: ``"global"`` (`M` times the heads, over all layers and heads together) or ``"head"`` (`M` per head).
        positions: the steps `t` the hinge is read at (sorted, distinct); drawn uniformly, the mean of the
            positive terms over them estimates the mean over all steps.
    """
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    kept = torch.cat([expected_kept(lb, positions) for lb in log_betas], dim=1)  # [batch, layers * kv_heads, P]
    pools = kept.shape[1]
    if scope == "global":
        kept, total, scale = kept.sum(1, keepdim=True), capacity * pools, pools
    else:
        total, scale = capacity, 1
    steps = torch.arange(kept.shape[-1], device=kept.device) if positions is None else positions.to(kept.device)
    steps = steps.to(kept.dtype) * scale
    hinge = torch.relu((kept - total) / (steps - total).clamp(min=1.0))
    positive = (hinge > 0).sum()
    return hinge.sum() / positive if positive > 0 else hinge.sum()
