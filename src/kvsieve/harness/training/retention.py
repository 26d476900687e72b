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
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from ...modeling.gates import RetentionGates
from ...modeling.rotary import unrotate
from ...runtime.attention.sieve import attention_implementation

ATTENTION_NAME = "retention"


@dataclass
class RetentionTape:
    """What one soft-retention forward needs and leaves behind.

    Attributes:
        gates: the retention gates being trained.
        cos, sin: `[T, head_dim]` the rotary embedding of positions `0..T-1` (to undo RoPE on the keys).
        log_beta: per gated layer, `[batch, kv_heads, T]` the log retention of every entry.
        fused: fold the decay bias into torch's fused causal kernel (`decayed_attention`); False builds it
            explicitly (`masked_decayed_attention`, as a padded batch needs), which the speed benchmark compares.
    """

    gates: RetentionGates
    cos: torch.Tensor
    sin: torch.Tensor
    log_beta: dict[int, torch.Tensor] = field(default_factory=dict)
    fused: bool = True


_TAPE: ContextVar[RetentionTape | None] = ContextVar("kvsieve_retention_tape", default=None)


def retention_bias(log_beta: torch.Tensor, queries: torch.Tensor | None = None) -> torch.Tensor:
    """`[..., Q, T]` additive attention bias: `(t - i) * log beta_i` for keys `i <= t`, `-inf` for later keys.

    `queries`: the query positions `t` (`[Q]`; default every position `0 .. T-1`).
    """
    steps = torch.arange(log_beta.shape[-1], device=log_beta.device)
    queries = steps if queries is None else queries.to(log_beta.device)
    distance = (queries[:, None] - steps[None, :]).to(log_beta.dtype)
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
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if tape.fused and _plain_causal(attention_mask, length):
        out = decayed_attention(query, key, value, log_beta, scale)
    else:
        out = masked_decayed_attention(query, key, value, log_beta, scale, attention_mask)
    return out.transpose(1, 2).contiguous(), None


def _plain_causal(attention_mask: torch.Tensor | None, length: int) -> bool:
    """Whether the mask `transformers` built allows exactly the causal triangle (no padding)."""
    if attention_mask is None:
        return True
    allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    causal = torch.ones(length, length, dtype=torch.bool, device=allowed.device).tril()
    return bool((allowed[..., :length] == causal).all())


def decayed_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_beta: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Causal attention whose logit of query `t` for key `i` gets `(t - i) * log_beta_i`, in torch's fused kernel.

    The bias is a dot product of two extra coordinates: `q'_t = [scaling q_t, t, 1]` and
    `k'_i = [k_i, log_beta_i, -i log_beta_i]` give `q'_t . k'_i = scaling q_t . k_i + (t - i) log_beta_i`,
    so no `T x T` bias is built. It runs in float32 at least (the positions must be exact); float32
    rounds the two products before they cancel, about 1e-4 on a logit at 1k tokens.
    `query [b, heads, T, d]`, `key`/`value [b, kv_heads, T, d]`, `log_beta [b, kv_heads, T]` -> `[b, heads, T, d]`.
    """
    dtype = torch.promote_types(query.dtype, torch.float32)
    group = query.shape[1] // key.shape[1]
    steps = torch.arange(key.shape[2], device=key.device, dtype=dtype)
    ones = torch.ones_like(query[..., :1], dtype=dtype)
    log_beta = log_beta.to(dtype)
    width = -(query.shape[-1] + 2) % 8 if query.is_cuda else 0  # zeros up to a multiple of 8 for CUDA's kernels
    queries = torch.cat([query.to(dtype) * scaling, steps[:, None].expand_as(ones), ones], dim=-1)
    keys = torch.cat([key.to(dtype), log_beta[..., None], (-steps * log_beta)[..., None]], dim=-1)
    queries, keys = (F.pad(x, (0, width)) for x in (queries, keys))
    values = F.pad(value.to(dtype), (0, 2 + width))  # the fused kernel takes one head dimension
    out = F.scaled_dot_product_attention(
        queries, keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1), is_causal=True, scale=1.0
    )
    return out[..., : value.shape[-1]].to(query.dtype)


def masked_decayed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_beta: torch.Tensor,
    scaling: float,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """`decayed_attention` with the bias built explicitly (`T x T` per head), under `transformers`' mask if given."""
    length, group = key.shape[2], query.shape[1] // key.shape[1]
    bias = retention_bias(log_beta).repeat_interleave(group, dim=1)
    if attention_mask is not None:
        allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        bias = bias.masked_fill(~allowed[..., :length], float("-inf"))
    # Not CUDA's memory-efficient kernel: its backward of a mask that needs a gradient fails (torch 2.11,
    # "LSE is not correctly aligned"; seen at head dimension 32, not at 64 or 128).
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(
            query,
            key.repeat_interleave(group, dim=1),
            value.repeat_interleave(group, dim=1),
            attn_mask=bias.to(query.dtype),
            scale=scaling,
        )


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
