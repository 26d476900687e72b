"""Sieve attention: exact attention over a ragged `SievedCache`, plus the statistics scorers need.

Registered in `transformers`' attention interface under the name ``"sieve"``. With dense
key/value tensors (any other cache, or none) it is exactly the model's own SDPA attention.
With a `LayerView` from a `SievedCache` it attends, per kv-head, to that head's stored
entries, masking causally by their original positions. During an observed prefill it
records the last `window` queries of every layer and, when a scorer needs it, computes
attention in query chunks to report the attention each key received from all queries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .cache import LayerStatistics, LayerView

ATTENTION_NAME = "sieve"

#: Elements of one chunk of attention probabilities (float32) in an observed prefill: 4 MiB
#: blocks stay in cache while softmax and the sums pass over them (larger chunks run slower).
CHUNK_ELEMENTS = 1 << 20


class UnsupportedAttentionError(ValueError):
    """The attention call uses a feature sieve attention cannot serve exactly."""


def _check_supported(module: torch.nn.Module, dropout: float, kwargs: dict) -> None:
    if kwargs.get("sliding_window") is not None:
        raise UnsupportedAttentionError("sliding-window attention layers are not supported by SievedCache yet")
    if kwargs.get("softcap") is not None:
        raise UnsupportedAttentionError("attention logit soft-capping is not supported by SievedCache yet")
    if dropout and module.training:
        raise UnsupportedAttentionError("attention dropout in training mode is not supported by SievedCache")
    if not getattr(module, "is_causal", True):
        raise UnsupportedAttentionError("SievedCache serves causal (decoder) attention only")


def _observed_head_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_positions: torch.Tensor,
    query_positions: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of one kv-head's query group, in query chunks, with the attention each key received.

    Args:
        query: `[group, q, d]`; keys, values: `[n, d]`; positions: `[n]` and `[q]`, both sorted.

    Returns:
        output `[group, q, d]` and the attention received per key, summed over all queries, `[group, n]`.

    A chunk of queries only reads the keys at or before its last query (causal block skipping).
    Peak extra memory: two float32 blocks of `group * chunk * n` elements (scores and
    probabilities) with `chunk = CHUNK_ELEMENTS // (group * n)`, i.e. about 8 MiB; the full
    `q x n` matrix is never held.
    """
    group, q_len, _ = query.shape
    n = keys.shape[0]
    chunk = max(1, CHUNK_ELEMENTS // max(1, group * n))
    out = torch.empty_like(query)
    received = torch.zeros(group, n, dtype=torch.float32, device=query.device)
    keys_t, values_f = keys.float().t(), values.float()
    visible_until = torch.searchsorted(key_positions, query_positions, right=True).tolist()
    for start in range(0, q_len, chunk):
        stop = min(q_len, start + chunk)
        # keys before `seen_by_all` are visible to every query of the chunk; only the rest need a mask
        seen_by_all, visible = visible_until[start], visible_until[stop - 1]
        scores = (query[:, start:stop].float() * scaling) @ keys_t[:, :visible]
        if visible > seen_by_all:
            future = key_positions[None, seen_by_all:visible] > query_positions[start:stop, None]
            scores[..., seen_by_all:visible].masked_fill_(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        del scores
        out[:, start:stop] = (probs @ values_f[:visible]).to(query.dtype)
        received[:, :visible] += probs.sum(dim=1)
    return out, received


def _head_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_positions: torch.Tensor,
    query_positions: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Exact attention of one kv-head's query group `[group, q, d]` over its stored entries `[n, d]` (SDPA).

    Positions are sorted, so three layouts cover every call: all keys precede all queries
    (decoding: no mask), keys are exactly the queries (a fresh prefill: causal), or anything
    else (a masked SDPA with the group folded into the query axis so the keys are read once).
    """
    group, q_len, dim = query.shape
    if keys.shape[0] == q_len and torch.equal(key_positions, query_positions):
        shape = (1, group, q_len, dim)
        keys, values = keys[None, None].expand(shape), values[None, None].expand(shape)
        return F.scaled_dot_product_attention(query[None], keys, values, is_causal=True, scale=scaling)[0]
    mask = None
    if int(key_positions[-1]) > int(query_positions[0]):
        mask = (key_positions[None, :] <= query_positions[:, None]).repeat(group, 1)
    folded = query.reshape(1, group * q_len, dim)
    out = F.scaled_dot_product_attention(folded, keys[None], values[None], attn_mask=mask, scale=scaling)
    return out.reshape(group, q_len, dim)


def sieve_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor | LayerView,
    value: torch.Tensor | LayerView,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function with the `transformers` attention-interface signature.

    `query` is `[batch, heads, q, head_dim]`; returns `[batch, q, heads, head_dim]`.
    """
    if not isinstance(key, LayerView):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    _check_supported(module, dropout, kwargs)
    view = key
    n_kv = len(view.keys)
    n_q_heads = query.shape[1]
    if n_q_heads % n_kv:
        raise UnsupportedAttentionError(f"{n_q_heads} query heads cannot be grouped over {n_kv} kv-heads")
    group = n_q_heads // n_kv
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    accumulate = view.recorder is not None and view.recorder.accumulate
    outputs, received = [], []
    for h in range(n_kv):
        q_h = query[0, h * group : (h + 1) * group]
        k_h, v_h, pos_h = view.keys[h][0], view.values[h][0], view.positions[h]
        if accumulate:
            out, rec = _observed_head_attention(q_h, k_h, v_h, pos_h, view.query_positions, scale)
            received.append(rec)
        else:
            out = _head_attention(q_h, k_h, v_h, pos_h, view.query_positions, scale)
        outputs.append(out)
    if view.recorder is not None:
        window = view.recorder.window
        output_projection = getattr(module, "o_proj", None)
        view.recorder(
            view.layer_idx,
            LayerStatistics(
                received=torch.cat(received) if accumulate else None,
                window_queries=query[0, :, -window:].float().clone(),
                window_positions=view.query_positions[-window:].clone(),
                scaling=scale,
                output_weight=None if output_projection is None else output_projection.weight.detach(),
            ),
        )
    attn_output = torch.cat(outputs, dim=0).unsqueeze(0)  # [1, heads, q, d]
    return attn_output.transpose(1, 2).contiguous(), None


def register_sieve_attention() -> None:
    """Register ``"sieve"`` in `transformers`' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, sieve_attention_forward)
    # Dense (non-sieved) calls get exactly the masks SDPA would get.
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


class UnhookableModelError(ValueError):
    """The model's attention cannot be routed through sieve attention."""


def enable_sieve_attention(model: torch.nn.Module) -> str:
    """Switch `model` to sieve attention; returns the implementation it used before.

    Raises `UnhookableModelError` for models whose attention does not go through the
    `transformers` attention interface or that use layers sieve attention cannot serve.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise UnhookableModelError(f"{type(model).__name__} is not a transformers PreTrainedModel")
    text_config = config.get_text_config(decoder=True)
    layer_types = getattr(text_config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or getattr(text_config, "sliding_window", None):
        raise UnhookableModelError(
            f"{type(model).__name__} uses sliding-window or chunked attention layers "
            f"({sorted(set(layer_types)) or 'sliding_window=' + str(text_config.sliding_window)}); "
            "SievedCache supports full-attention layers only for now"
        )
    previous = config._attn_implementation
    if previous == ATTENTION_NAME:
        return previous
    if not model._can_set_attn_implementation():
        raise UnhookableModelError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, "
            "so kvsieve cannot hook it"
        )
    register_sieve_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    if config._attn_implementation != ATTENTION_NAME:
        raise UnhookableModelError(f"could not switch {type(model).__name__} to sieve attention")
    return previous
