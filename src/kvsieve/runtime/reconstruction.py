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

from ..selection.observation import Reconstruction
from .attention import sieve_attention
from .cache import SievedCache

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
    """Attention for the repetition's forwards (`flash_attention` on the CPU, else `materialized_attention`;
    the cache holds no padding, so the mask is causal); per layer, the most each of the first `context`
    entries got."""

    def __init__(self, context: int) -> None:
        self.context = context
        self.most: dict[int, torch.Tensor] = {}  # layer -> [rows, q_heads, context]

    def attend(
        self,
        layer_idx: int,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float,
    ) -> torch.Tensor:
        group = query.shape[1] // key.shape[1]
        keys, values = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        attend = flash_attention if query.device.type == "cpu" else materialized_attention
        out, seen = attend(query, keys, values, scaling, self.context)
        held = self.most.get(layer_idx)
        self.most[layer_idx] = seen if held is None else torch.maximum(held, seen)
        return out.transpose(1, 2).contiguous()


def _hidden(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`[q, length]` causal: the queries are the last of the keys' positions."""
    positions = torch.arange(keys.shape[2], device=query.device)
    return positions[None, :] > positions[keys.shape[2] - query.shape[2] :, None]


def flash_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output `[rows, heads, q, d]`, the most probability each of the first `context` keys got `[rows, heads,
    context]`): torch's CPU flash kernel gives the output and every query's log-sum-exp, and a probability is
    `exp(q.k * scale - lse)`, computed for those keys only (every query sees them all)."""
    bias = torch.zeros(query.shape[2], keys.shape[2], dtype=query.dtype).masked_fill(
        _hidden(query, keys), float("-inf")
    )
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(query, keys, values, 0.0, False, attn_mask=bias[None, None], scale=scaling)
    scores = (query @ keys[:, :, :context].transpose(-1, -2)).to(lse.dtype) * scaling
    return out, (scores - lse[..., None]).exp().amax(dim=2)


def materialized_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`flash_attention`'s result from the whole probability matrix, float32 or wider (any device)."""
    dtype = torch.promote_types(query.dtype, torch.float32)
    scores = (query.to(dtype) @ keys.to(dtype).transpose(-1, -2)) * scaling
    probs = torch.softmax(scores.masked_fill(_hidden(query, keys), float("-inf")), dim=-1)
    return (probs @ values.to(dtype)).to(query.dtype), probs[..., :context].amax(dim=2)


@torch.no_grad()
def reconstruct(
    model: torch.nn.Module,
    cache: SievedCache,
    input_ids: torch.Tensor,
    reconstruction: Reconstruction,
    tokenizer: PreTrainedTokenizerBase,
) -> dict[int, torch.Tensor]:
    """Per full-attention layer, `[rows, q_heads, n]`: the most attention each entry of `cache` (the unpadded
    prefill of `input_ids`, `[rows, n]`) received while the model repeated `input_ids` after it."""
    n = input_ids.shape[1]
    repeat = repeat_prompt_ids(tokenizer, reconstruction.prompt).to(input_ids.device).expand(input_ids.shape[0], -1)
    recorder = ReconstructionRecorder(n)
    with sieve_attention(model):
        for start in range(0, n, reconstruction.chunk):
            copy = cache.copy()
            copy.recorder = recorder
            ids = torch.cat([repeat, input_ids[:, start : start + reconstruction.chunk]], dim=-1)
            model(input_ids=ids, past_key_values=copy, use_cache=True, logits_to_keep=1)
    return recorder.most
