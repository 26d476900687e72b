"""Sieve attention: exact attention over a `SievedCache`, plus the statistics an observed prefill records.

Registered in `transformers`' attention interface as ``"sieve"`` (with `transformers`' signature)
the first time a model is switched to it. For tensors of any other cache, and for a `SievedCache`
from which nothing was evicted, it *is* the model's SDPA attention. For an evicted cache it reads
the layer's `RaggedLayout` to see which cache position each padded column holds, builds the
visibility of every column to every query from it (and from the attention mask `transformers`
built over the logical sequence), and runs one kernel call per layer (`kvsieve.kernels.attention`): a
masked SDPA, or on CUDA in half precision, for decoding steps, torch's fused varlen kernel.

Switching is scoped: `with sieve_attention(model): ...` restores the model's own attention on exit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ...kernels.attention import masked_sdpa, merged_sdpa, tallied_attention, varlen_attention, varlen_available
from ...modeling.architecture import layer_windows
from ...modeling.errors import UnhookableModelError
from ..compat import attention_implementation_of
from ..inputs import check_model
from ..storage.layout import RaggedLayout, active_scope, sieve_scope
from ..storage.segments import PAD_POSITION

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ATTENTION_NAME = "sieve"


class UnsupportedAttentionError(ValueError):
    """The attention call uses a feature sieve attention cannot serve exactly."""


def _check_supported(module: torch.nn.Module, dropout: float, kwargs: dict) -> None:
    if kwargs.get("sliding_window") is not None:
        raise UnsupportedAttentionError(
            "this SievedCache stores a sliding-window layer as an evictable one; build the cache for the model: "
            "kvsieve.SievedCache.for_model(model)"
        )
    if kwargs.get("softcap") is not None:
        raise UnsupportedAttentionError("attention logit soft-capping is not supported by SievedCache yet")
    if dropout and module.training:
        raise UnsupportedAttentionError("attention dropout in training mode is not supported by SievedCache")


def visibility(layout: RaggedLayout, attention_mask: torch.Tensor | None, q: int) -> torch.Tensor | None:
    """`[rows, kv_heads, q, length]`: which padded column each query may attend (None: all of them).

    A bool mask, or for a decoding step an additive one (0 / -inf) that the layer keeps ready.

    `attention_mask` is `transformers`' mask over the logical sequence (`[rows, 1, q, kv_length]`,
    bool or additive); it is read at each column's cache position.
    """
    slots = layout.slots
    if attention_mask is not None:
        positions = slots.positions()
        allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        rows, heads, length = positions.shape
        index = positions.clamp(max=allowed.shape[-1] - 1)[:, :, None, :].expand(rows, heads, q, length)
        return allowed.expand(rows, heads, q, -1).gather(3, index) & (positions != PAD_POSITION)[:, :, None, :]
    if q > 1:
        return slots.positions()[:, :, None, :] <= layout.query_positions[:, None]
    return None if slots.bias is None else slots.bias[:, :, None, :]


def sieve_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`transformers`' attention-function signature: `query [batch, heads, q, d]` -> `[batch, q, heads, d]`."""
    scope = active_scope()
    layout = None if scope is None else scope.layout_of(key)
    if layout is None or (layout.contiguous and layout.recorder is None and layout.tally is None):
        out, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    else:
        _check_supported(module, dropout, kwargs)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = _ragged_attention(layout, module, query, key, value, attention_mask, scale)
    if layout is not None and layout.queries is not None:
        layout.queries.append(layout.layer_idx, query, out.transpose(1, 2), layout.query_positions)
    return out, None


def _ragged_attention(
    layout: RaggedLayout,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Attention over the layer's padded view: tallied, recorded, with merged entries, varlen for a decoding step, or
    masked SDPA."""
    if layout.merged is not None and (layout.tally is not None or layout.recorder is not None):
        raise UnsupportedAttentionError("a layer with merged entries is neither observed again nor tallied")
    if layout.tally is not None:
        out, received = tallied_attention(query, key, value, visibility(layout, attention_mask, query.shape[2]), scale)
        layout.tally.add_received(received)
        return out
    if layout.recorder is not None:
        return layout.recorder.attend(layout, module, query, key, value, attention_mask, scale)
    if layout.merged is not None:
        visible = visibility(layout, attention_mask, query.shape[2])
        return merged_sdpa(query, key, value, visible, layout.merged, scale)
    if attention_mask is None and query.shape[2] == 1 and varlen_available(query):
        valid = layout.slots.valid()
        return varlen_attention(query, key, value, None if valid is None else valid.sum(-1), scale)
    return masked_sdpa(query, key, value, visibility(layout, attention_mask, query.shape[2]), scale)


def register_sieve_attention() -> None:
    """Register ``"sieve"`` in `transformers`' attention and mask interfaces (idempotent)."""
    # imported at the first switch, not with kvsieve: these modules cost most of a second to import
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, sieve_attention_forward)
    # Masks are built as for SDPA: over the logical sequence, which sieve attention reads per entry.
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


@contextmanager
def attention_implementation(model: PreTrainedModel, name: str) -> Iterator[PreTrainedModel]:
    """Run the block with `model` on the attention implementation `name`; restore the previous one after.

    Raises `UnhookableModelError` where `transformers`' public `set_attn_implementation` leaves the model on its
    own attention (a model whose attention does not go through `AttentionInterface`).
    """
    previous = attention_implementation_of(model)
    if previous != name:
        model.set_attn_implementation(name)
        if attention_implementation_of(model) != name:
            raise UnhookableModelError(
                f"{type(model).__name__} does not route attention through transformers' AttentionInterface, "
                "so kvsieve cannot hook it"
            )
    try:
        yield model
    finally:
        if attention_implementation_of(model) != previous:
            model.set_attn_implementation(previous)


@contextmanager
def sieve_attention(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run the block with `model` on sieve attention (exact for every cache); its own attention comes back after.

    Raises `UnhookableModelError` for models whose attention does not go through the
    `transformers` attention interface or that use layers sieve attention cannot serve
    (`kvsieve.modeling.architecture.layer_windows`: full-attention and sliding-window layers are served).
    """
    check_model(model)
    layer_windows(model)
    register_sieve_attention()
    with attention_implementation(model, ATTENTION_NAME), sieve_scope():
        yield model
