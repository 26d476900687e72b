"""Attention over a padded view of ragged per-(row, kv-head) entries: one kernel call per layer.

Shared by both runtimes (`kvsieve.runtime`'s sieve attention and the vLLM plugin's attention of compacted requests);
it imports nothing of kvsieve.

Every function takes `query [rows, q_heads, q, d]`, the padded `keys`/`values [rows, kv_heads,
length, d]` a `SievedLayer` returned, and `visible [rows, kv_heads, q, length]` (bool, or an
additive 0/-inf bias for a decoding step; None when every column is visible to every query),
and returns `[rows, q, q_heads, d]` as `transformers`' attention functions do. The query heads
of a kv-head are folded into the query axis, so keys and values are read once and no call is
made per head or per row.

- `masked_sdpa`: one `scaled_dot_product_attention` with the visibility as its mask (every device).
- `merged_sdpa`: `masked_sdpa` with each (row, kv-head)'s merged entries (`kvsieve.selection.merge`) as more
  columns, their logits raised by their biases.
- `varlen_attention`: CUDA, half precision, no attention mask: torch's fused varlen flash kernel
  (`torch.nn.attention.varlen`), every (row, kv-head) one sequence of its own length, read in
  place from the padded tensors (no mask is built).
- `reference_attention`: float64, one (row, query head) at a time; the exact reference the tests hold the others to.
- `observed_attention`: a fresh prefill that also sums the attention every key receives, in query
  chunks, so the `q x n` matrix is never held whole.
- `tallied_attention`: attention over a padded view that also returns the attention every column
  received (H2O's statistic during generation), with an explicit softmax in query chunks.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F


class MergedColumns(Protocol):
    """Each (row, kv-head)'s merged entries: `keys`, `values [rows, kv_heads, m, d]` and logit `bias [rows, kv_heads,
    m]` (-inf for an empty one); the runtime's `MergedEntries`, the vLLM plugin's gathered ones."""

    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor


#: Attention weights (float32) per (row, query head) in one chunk of an observed prefill: the
#: chunk's query count depends on the context length only, so the number of calls does not grow
#: with heads or rows. 256k (1 MiB per head) on the default model's shapes: 4% faster than 128k
#: at 4k (17% slower at 2k, where the prefill is cheap anyway); 512k and 1M were slower at both.
CHUNK_ELEMENTS = 1 << 18


def _fold(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`[rows, q_heads, q, d]` -> `[rows, kv_heads, group * q, d]`: each kv-head's query heads side by side."""
    rows, q_heads, q, dim = query.shape
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads cannot be grouped over {kv_heads} kv-heads")
    return query.reshape(rows, kv_heads, (q_heads // kv_heads) * q, dim)


def _unfold(out: torch.Tensor, q_heads: int, q: int) -> torch.Tensor:
    """`[rows, kv_heads, group * q, d]` -> `[rows, q, q_heads, d]` (contiguous)."""
    return out.reshape(out.shape[0], q_heads, q, out.shape[-1]).transpose(1, 2).contiguous()


def masked_sdpa(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Exact attention as one `scaled_dot_product_attention` call, the visibility as its mask."""
    rows, q_heads, q, _ = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    mask = visible
    if mask is not None and q > 1:
        group = q_heads // kv_heads
        mask = mask[:, :, None].expand(rows, kv_heads, group, q, length).reshape(rows, kv_heads, group * q, length)
    out = F.scaled_dot_product_attention(_fold(query, kv_heads), keys, values, attn_mask=mask, scale=scaling)
    return _unfold(out, q_heads, q)


def merged_sdpa(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor | None,
    merged: MergedColumns,
    scaling: float,
) -> torch.Tensor:
    """`masked_sdpa` with each (row, kv-head)'s merged entries as more columns, their logits raised by their biases."""
    rows, heads, length, _ = keys.shape
    q, parts = query.shape[2], merged.bias.shape[-1]
    keys = torch.cat([keys, merged.keys.to(keys.dtype)], 2)
    values = torch.cat([values, merged.values.to(values.dtype)], 2)
    if visible is None:
        additive = query.new_zeros(rows, heads, q, length)
    elif visible.dtype == torch.bool:
        additive = query.new_zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    else:
        additive = visible.to(query.dtype).expand(rows, heads, q, length)
    bias = merged.bias.to(query.dtype)[:, :, None].expand(rows, heads, q, parts)
    return masked_sdpa(query, keys, values, torch.cat([additive, bias], -1), scaling)


def reference_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """The same attention in float64 with an explicit softmax, one (row, query head) at a time (`visible`: bool, or
    an additive mask)."""
    rows, q_heads, q, dim = query.shape
    group = q_heads // keys.shape[1]
    out = torch.empty(rows, q, q_heads, dim, dtype=query.dtype, device=query.device)
    for row in range(rows):
        for head in range(q_heads):
            kv = head // group
            scores = (query[row, head].double() @ keys[row, kv].double().T) * scaling
            if visible is not None and visible.dtype == torch.bool:
                scores = scores.masked_fill(~visible[row, kv], float("-inf"))
            elif visible is not None:
                scores = scores + visible[row, kv].double()
            probs = torch.softmax(scores, dim=-1)
            out[row, :, head] = (probs @ values[row, kv].double()).to(query.dtype)
    return out


def observed_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    query_weight: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a fresh prefill, with the attention every key receives.

    Args:
        query: `[rows, q_heads, n, d]`; keys, values: `[rows, kv_heads, n, d]` (column = cache position).
        attention_mask: `[rows, 1, n, n]` bool from `transformers` (padding and causality), or None for
            plain causal attention.
        query_weight: `[rows, n]` how much each query counts in the sums (0 for padding), or None.

    Returns:
        output `[rows, n, q_heads, d]` and received `[rows, q_heads, n]`: the attention each key
        received, summed over the queries (weighted).

    A chunk of queries only reads the keys up to its last query (causality). The exponentials are
    computed in place and never normalised as a matrix: the output is `(E @ V) / sum(E)` and the
    received attention `(w / sum(E)) @ E`, one matrix-vector product. Peak extra memory: one float32
    block of `rows * q_heads * CHUNK_ELEMENTS`; the `n x n` matrix is never held.
    """
    rows, q_heads, n, dim = query.shape
    kv_heads = keys.shape[1]
    group = q_heads // kv_heads
    chunk = max(1, CHUNK_ELEMENTS // n)
    grouped = query.float().reshape(rows, kv_heads, group, n, dim) * scaling
    keys_t, values_f = keys.float().transpose(-1, -2), values.float()
    out = torch.empty(rows, kv_heads, group, n, dim, dtype=torch.float32, device=query.device)
    received = torch.zeros(rows, kv_heads, group, 1, n, dtype=torch.float32, device=query.device)
    columns = torch.arange(n, device=query.device)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        size = stop - start
        # the group's queries of the chunk side by side, so each kv-head's keys are read once
        block = grouped[:, :, :, start:stop].reshape(rows, kv_heads, group * size, dim)
        scores = (block @ keys_t[..., :stop]).view(rows, kv_heads, group, size, stop)
        if attention_mask is None:  # causal: only the chunk's own block of keys has future ones
            scores[..., start:stop].masked_fill_(columns[None, start:stop] > columns[start:stop, None], float("-inf"))
        else:
            scores.masked_fill_(~attention_mask[:, :, start:stop, :stop].unsqueeze(2), float("-inf"))
        top = scores.amax(dim=-1, keepdim=True).nan_to_num_(neginf=0.0)  # a query that sees nothing gets 0
        weights = scores.sub_(top).exp_()
        inverse = weights.sum(dim=-1, keepdim=True).reciprocal_().nan_to_num_(posinf=0.0)
        attended = weights.view(rows, kv_heads, group * size, stop) @ values_f[..., :stop, :]
        out[..., start:stop, :] = attended.view(rows, kv_heads, group, size, dim) * inverse
        if query_weight is not None:
            inverse = inverse * query_weight[:, None, None, start:stop, None]
        received[..., :stop] += inverse.transpose(-1, -2) @ weights
    return _unfold(out.reshape(rows, kv_heads, group * n, dim), q_heads, n).to(query.dtype), received.flatten(1, 3)


def tallied_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor | None,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention (float32 softmax) and the attention every column received from the forward's queries.

    Returns the output `[rows, q, q_heads, d]` and received `[rows, kv_heads, length, group]`: summed
    over the queries, per query head of each kv-head's group. Queries go in chunks of at most
    `CHUNK_ELEMENTS` weights per (row, query head); a query that sees nothing receives and gives 0.
    """
    rows, q_heads, q, dim = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    grouped = query.float().reshape(rows, kv_heads, group, q, dim) * scaling
    keys_t, values_f = keys.float().transpose(-1, -2)[:, :, None], values.float()[:, :, None]
    out = torch.empty(rows, kv_heads, group, q, dim, dtype=torch.float32, device=query.device)
    received = torch.zeros(rows, kv_heads, group, length, dtype=torch.float32, device=query.device)
    chunk = max(1, CHUNK_ELEMENTS // max(length, 1))
    for start in range(0, q, chunk):
        stop = min(q, start + chunk)
        scores = grouped[:, :, :, start:stop] @ keys_t  # [rows, kv, group, size, length]
        if visible is not None and visible.dtype == torch.bool:
            scores.masked_fill_(~visible[:, :, None, start:stop], float("-inf"))
        elif visible is not None:
            scores += visible[:, :, None]  # a decoding step's additive bias
        weights = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
        out[:, :, :, start:stop] = weights @ values_f
        received += weights.sum(dim=3)
    return _unfold(out.reshape(rows, kv_heads, group * q, dim), q_heads, q).to(query.dtype), received.transpose(2, 3)


#: What `varlen_attention` passes to torch's kernel beyond the sequences (torch 2.11's kernel lacks `enable_gqa`).
VARLEN_ARGUMENTS = ("enable_gqa", "seqused_k")


@functools.cache
def _varlen_kernel() -> Callable[..., torch.Tensor] | None:
    """torch's fused varlen flash kernel (CUDA), or None in a torch whose kernel lacks `VARLEN_ARGUMENTS`.

    Imported on first use, not with kvsieve: its module loads `torch._dynamo` (about 0.4 s).
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    return varlen_attn if all(name in parameters for name in VARLEN_ARGUMENTS) else None


def varlen_available(query: torch.Tensor) -> bool:
    """Whether the fused varlen kernel serves this query (CUDA, fp16/bf16, a torch that has it)."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and _varlen_kernel() is not None


def varlen_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Attention of one decoding query per (row, query head) over the first `lengths` entries of its kv-head.

    Every (row, kv-head) is one varlen sequence whose query heads are its group. Keys and values
    may be a padded view of wider storage (`[rows, kv_heads, length, d]` with a row stride of
    `capacity * d`): the kernel reads the storage in place, `capacity` entries apart.
    """
    rows, q_heads, q, dim = query.shape
    if q != 1:
        raise ValueError(f"varlen_attention serves decoding steps (one query per row), got {q}")
    kv_heads, length = keys.shape[1], keys.shape[2]
    segments, capacity = rows * kv_heads, keys.stride(1) // dim
    flat = [t.as_strided((segments * capacity, 1, dim), (dim, dim, 1)) for t in (keys, values)]
    used = torch.full((segments,), length, device=query.device) if lengths is None else lengths.reshape(segments)
    steps = torch.arange(segments + 1, device=query.device, dtype=torch.int32)
    out = _varlen_kernel()(
        query.reshape(segments, q_heads // kv_heads, dim).contiguous(),  # one sequence per (row, kv-head)
        *flat,
        steps,
        steps * capacity,
        1,
        length,
        scale=scaling,
        enable_gqa=True,
        seqused_k=used.to(torch.int32),
    )
    return out.reshape(rows, 1, q_heads, dim)
