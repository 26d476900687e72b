"""KVzip's reconstruction pass (arXiv 2505.23416): the model repeats its context after it, and every
prefilled entry keeps the most attention any query of the repetition gave it.

The repetition is the instruction (`Reconstruction.prompt`, closing the user turn and opening the
assistant's where the tokenizer has a chat template) followed by the context, `chunk` tokens a
forward. Each chunk is fed on a copy of the prefilled cache, so it sees the whole context and its
own repetition; the prefilled cache itself is left as it was. The probabilities read are exact;
a chunk bounds the `[heads, prompt + chunk, n]` of them a layer computes at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...selection.observation import Reconstruction
from ..attention.sieve import sieve_attention, visibility
from ..compat import cache_argument
from ..storage.cache import SievedCache
from ..storage.layout import RaggedLayout

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def repeat_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> torch.Tensor:
    """`[1, p]` the instruction to repeat the context, then the chat template's turn change where there is one."""
    if tokenizer.chat_template is None:
        text = prompt + "\n"
    else:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        marker = prompt.strip()
        if marker not in rendered:
            raise ValueError(f"the tokenizer's chat template does not keep the prompt {prompt!r} as it is")
        text = prompt + rendered.split(marker, 1)[1]  # the end of the user turn, the assistant's header
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


class ReconstructionRecorder:
    """Attention for the repetition's forwards (`flash_attention` on the CPU, else `materialized_attention`); per
    layer, the most each cache position below `context` got."""

    def __init__(self, context: int) -> None:
        self.context = context
        self.most: dict[int, torch.Tensor] = {}  # layer -> [rows, q_heads, context]

    def attend(
        self,
        layout: RaggedLayout,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float,
    ) -> torch.Tensor:
        group = query.shape[1] // key.shape[1]
        keys, values = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        hidden = _hidden(layout, attention_mask, query.shape[2], keys.shape[2], group)
        columns = self.context if layout.contiguous else keys.shape[2]  # an evicted cache: read every column
        attend = flash_attention if query.device.type == "cpu" else materialized_attention
        out, seen = attend(query, keys, values, scaling, hidden, columns)
        if not layout.contiguous:
            seen = _by_position(seen, layout.slots.positions().repeat_interleave(group, dim=1), self.context)
        held = self.most.get(layout.layer_idx)
        self.most[layout.layer_idx] = seen if held is None else torch.maximum(held, seen)
        return out.transpose(1, 2).contiguous()


def _hidden(
    layout: RaggedLayout, attention_mask: torch.Tensor | None, q: int, columns: int, group: int
) -> torch.Tensor:
    """What each query may not see, broadcastable to `[rows, q_heads, q, columns]`: the causal mask `[q, columns]`
    where nothing was evicted or padded, else the mask over the columns as sieve attention reads them."""
    if not layout.contiguous:
        return ~visibility(layout, attention_mask, q).repeat_interleave(group, dim=1)
    if attention_mask is not None:  # transformers' mask over the cache positions, `[rows, 1, q, columns]`
        return ~attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
    positions = torch.arange(columns, device=layout.query_positions.device)
    return positions[None, :] > positions[columns - q :, None]


def _by_position(seen: torch.Tensor, positions: torch.Tensor, context: int) -> torch.Tensor:
    """`seen [rows, q_heads, columns]` moved to the cache position each column holds (`positions`, same shape):
    `[rows, q_heads, context]`, 0 where no column holds a position."""
    spill = torch.where(positions < context, positions, context)  # padding and the repetition itself
    dense = seen.new_zeros(*seen.shape[:2], context + 1)
    return dense.scatter_reduce_(2, spill, seen, "amax")[..., :context]


def flash_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    hidden: torch.Tensor,
    columns: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output `[rows, heads, q, d]`, the most probability each of the first `columns` keys got `[rows, heads,
    columns]`): torch's CPU flash kernel gives the output and every query's log-sum-exp, and a probability is
    `exp(q.k * scale - lse)`, computed for those keys only. `hidden`: what each query may not see, broadcastable
    to `[rows, heads, q, keys]`."""
    bias = torch.zeros(hidden.shape, dtype=query.dtype).masked_fill(hidden, float("-inf"))
    bias = bias if bias.ndim == 4 else bias[None, None]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(query, keys, values, 0.0, False, attn_mask=bias, scale=scaling)
    scores = (query @ keys[:, :, :columns].transpose(-1, -2)).to(lse.dtype) * scaling
    scores = scores.masked_fill(hidden[..., :columns], float("-inf"))
    return out, (scores - lse[..., None]).exp().amax(dim=2)


def materialized_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    hidden: torch.Tensor,
    columns: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`flash_attention`'s result from the whole probability matrix, float32 or wider (any device)."""
    dtype = torch.promote_types(query.dtype, torch.float32)
    scores = (query.to(dtype) @ keys.to(dtype).transpose(-1, -2)) * scaling
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return (probs @ values.to(dtype)).to(query.dtype), probs[..., :columns].amax(dim=2)


@torch.no_grad()
def reconstruct(
    model: torch.nn.Module,
    cache: SievedCache,
    input_ids: torch.Tensor,
    reconstruction: Reconstruction,
    tokenizer: PreTrainedTokenizerBase,
    real: torch.Tensor | None = None,
) -> dict[int, torch.Tensor]:
    """Per full-attention layer, `[rows, q_heads, cache.get_seq_length()]`: the most attention each cache position
    received while the model repeated its sequence after `cache` (0 for positions the cache no longer holds).

    Args:
        cache: what the model holds of `input_ids` (evicted or not); it is left as it was.
        input_ids: `[rows, n]` every token the cache was fed, padding included.
        real: `[rows, n]` bool, the real tokens (None: all of them). A padded batch repeats row by row.
    """
    repeat = repeat_prompt_ids(tokenizer, reconstruction.prompt).to(input_ids.device)
    if real is None or bool(real.all()):
        return _repeat_after(model, cache, input_ids, repeat, reconstruction.chunk)
    per_row = [
        _repeat_after(model, cache.copy(rows=[row]), input_ids[row : row + 1, mask], repeat, reconstruction.chunk,
                      mask[None])
        for row, mask in enumerate(real)
    ]  # fmt: skip
    return {layer: torch.cat([most[layer] for most in per_row]) for layer in per_row[0]}


def _repeat_after(
    model: torch.nn.Module,
    cache: SievedCache,
    tokens: torch.Tensor,
    repeat: torch.Tensor,
    chunk: int,
    real: torch.Tensor | None = None,
) -> dict[int, torch.Tensor]:
    """`reconstruct` of rows whose real tokens are `tokens` (one row when `real`, its mask over the cache, is
    given): the repetition continues each row's positions, and padding stays hidden."""
    recorder = ReconstructionRecorder(cache.get_seq_length())
    repeat = repeat.expand(tokens.shape[0], -1)
    with sieve_attention(model):
        for start in range(0, tokens.shape[1], chunk):
            copy = cache.copy()
            copy.recorder = recorder
            ids = torch.cat([repeat, tokens[:, start : start + chunk]], dim=-1)
            padding = {}
            if real is not None:
                mask = torch.cat([real, real.new_ones(1, ids.shape[1])], dim=-1).long()
                positions = torch.arange(ids.shape[1], device=ids.device)[None] + int(real.sum())
                padding = {"attention_mask": mask, "position_ids": positions}
            model(input_ids=ids, **cache_argument(model, copy), use_cache=True, logits_to_keep=1, **padding)
    return recorder.most
