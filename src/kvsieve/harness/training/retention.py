"""Soft retention: the differentiable stand-in for eviction that retention gates are trained through.

Inside `soft_retention(model, gates)`, every gated layer's attention adds `(t - i) * log beta_i` to
the logit of query `t` for key `i` (the entry's survival probability `beta_i^(t - i)` multiplies its
attention weight). With every `log beta = 0` that is exactly the model's own attention. The attention
function records each layer's `log beta` on a `RetentionTape`, from which the capacity loss is computed.
The model runs through `transformers`' attention interface (``"retention"``); nothing is patched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from ...runtime.attention import attention_implementation
from ...selection.gates import RetentionGates
from ...selection.rotary import unrotate

ATTENTION_NAME = "retention"


@dataclass
class RetentionTape:
    """What one soft-retention forward needs and leaves behind.

    Attributes:
        gates: the retention gates being trained.
        cos, sin: `[T, head_dim]` the rotary embedding of positions `0..T-1` (to undo RoPE on the keys).
        log_beta: per gated layer, `[batch, kv_heads, T]` the log retention of every entry.
    """

    gates: RetentionGates
    cos: torch.Tensor
    sin: torch.Tensor
    log_beta: dict[int, torch.Tensor] = field(default_factory=dict)


_TAPE: ContextVar[RetentionTape | None] = ContextVar("kvsieve_retention_tape", default=None)


def retention_bias(log_beta: torch.Tensor) -> torch.Tensor:
    """`[..., T, T]` additive attention bias: `(t - i) * log beta_i` for keys `i <= t`, `-inf` above the diagonal."""
    length = log_beta.shape[-1]
    steps = torch.arange(length, device=log_beta.device)
    distance = (steps[:, None] - steps[None, :]).to(log_beta.dtype)
    bias = distance * log_beta[..., None, :]
    return bias.masked_fill(distance < 0, float("-inf"))


def soft_retention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`transformers`' attention-function signature; ungated layers run the model's SDPA attention."""
    tape = _TAPE.get()
    if tape is None or module.layer_idx not in tape.gates.shape.layers:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    length = key.shape[2]
    if query.shape[2] != length or length > tape.cos.shape[0]:
        raise ValueError("soft retention runs a whole sequence at once, without a cache")
    keys = unrotate(key.float(), tape.cos[:length], tape.sin[:length])
    log_beta = tape.gates.log_beta(module.layer_idx, keys, value.float())
    tape.log_beta[module.layer_idx] = log_beta
    group = query.shape[1] // key.shape[1]
    bias = retention_bias(log_beta).repeat_interleave(group, dim=1)
    if attention_mask is not None:
        allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        bias = bias.masked_fill(~allowed[..., :length], float("-inf"))
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key.repeat_interleave(group, dim=1),
        value.repeat_interleave(group, dim=1),
        attn_mask=bias.to(query.dtype),
        scale=scaling,
    )
    return out.transpose(1, 2).contiguous(), None


@contextmanager
def soft_retention(model: PreTrainedModel, tape: RetentionTape) -> Iterator[RetentionTape]:
    """Run the block with `model`'s gated layers under soft retention, recording on `tape`."""
    AttentionInterface.register(ATTENTION_NAME, soft_retention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
    token = _TAPE.set(tape)
    try:
        with attention_implementation(model, ATTENTION_NAME):
            yield tape
    finally:
        _TAPE.reset(token)
