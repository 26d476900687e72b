"""Rotary position embedding (RoPE): a model's embedding as a function, and undoing the rotation of queries and keys."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .architecture import FULL_ATTENTION

#: `positions [n] -> (cos, sin)`, each `[n, head_dim]`: the model's rotary embedding.
Rotary = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The RoPE partner of each coordinate: `(x1, x2) -> (-x2, x1)` over the two halves of the last axis."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Invert `x * cos + rotate_half(x) * sin` (RoPE, possibly scaled) for `x [..., w, d]`, `cos, sin [w, r]`.

    With partial rotary embeddings (GPT-NeoX, `r < d`) only the first `r` coordinates were rotated.
    """
    rotated = cos.shape[-1]
    head, rest = x[..., :rotated], x[..., rotated:]
    head = (head * cos - rotate_half(head) * sin) / (cos * cos + sin * sin)
    return torch.cat([head, rest], dim=-1) if rest.shape[-1] else head


def find_rotary(model: torch.nn.Module) -> Rotary:
    """The model's rotary embedding (of its full-attention layers) as `positions -> (cos, sin)`, or a clear error."""
    module = getattr(model.base_model, "rotary_emb", None)
    if module is None:
        raise ValueError(f"{type(model).__name__} has no rotary embedding (rotary_emb), which the scorer needs")
    # models whose rope parameters are given per layer type (Gemma-3) embed each type apart
    per_type = FULL_ATTENTION in (model.config.get_text_config(decoder=True).rope_parameters or {})
    kind = (FULL_ATTENTION,) if per_type else ()

    def rotary(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.zeros(1, dtype=torch.float32, device=positions.device)
        cos, sin = module(probe, positions[None], *kind)
        return cos[0].float(), sin[0].float()

    return rotary
