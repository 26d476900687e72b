"""Generating from a compressed prompt: the one path `kvsieve.generate` and `kvsieve.apply` share.

The prompt (a context, then optionally a question) is compressed but for its last token, which
`generate` then feeds first; with a question the compression is question-aware and the question
stays protected. One rule for prompts too short to evict: under a rate, a prompt some row of which
has nothing evictable (every entry is a sink or in the recent tail) is not compressed, and
`generate` runs on the model's own cache (with quantized entries, `kv_bits` < 16: on a cache that
keeps every entry, quantized); under a size, a prompt of one token starts from an empty cache held
at the size. Beam search is refused: rows of a compressed cache are not reordered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...selection.budget import Budget, Rate
from ...selection.errors import PolicyError
from ...selection.policy import Policy
from ...selection.projection import MISSING_SPANS
from ..attention.sieve import sieve_attention
from ..compat import cache_argument
from ..inputs import check_input_ids, protected_positions, real_tokens
from ..storage.cache import SievedCache
from ..storage.codecs import EntryCodec, storage_codec
from .compress import BUFFER_NEEDS_SIZE, bounded_cache_with, compress_with

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def refuse_beams(model: torch.nn.Module, generate_kwargs: dict, what: str) -> None:
    """A clear error if `generate` would run beam search (asked for, or the model's generation config)."""
    if int(generate_kwargs.get("num_beams") or model.generation_config.num_beams or 1) > 1:
        raise PolicyError(f"beam search cannot run on {what}; use greedy decoding or sampling")


@dataclass(frozen=True)
class PromptOptions:
    """What `kvsieve.generate` passes on to the compression of its prompt besides the policy and the budget, with
    `kvsieve.compress`'s names (`apply` passes none: they are not `model.generate`'s keywords)."""

    chunk: int | None = None
    protect_positions: Sequence[int] | torch.Tensor | None = None
    spans: torch.Tensor | None = None

    def up_to(self, n: int) -> dict[str, object]:
        """The options for the prompt's first `n` tokens (positions are checked against the whole prompt first)."""
        protect, spans = self.protect_positions, self.spans
        return {
            "chunk": self.chunk,
            "protect_positions": None if protect is None else protect[protect < n],
            "spans": spans[..., :n] if isinstance(spans, torch.Tensor) else spans,
        }


NO_OPTIONS = PromptOptions()


def prompt_with_question(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, question_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole prompt `generate` reads (the context, then the question) and its attention mask."""
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    if question_ids is None:
        return input_ids, mask
    ids = torch.cat([input_ids, question_ids.to(input_ids.device)], dim=-1)
    return ids, torch.cat([mask, torch.ones_like(question_ids, device=mask.device)], dim=-1)


def compressed_prompt(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    question_ids: torch.Tensor | None,
    policy: Policy,
    budget: Budget,
    buffer: int | None,
    codec: EntryCodec | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    options: PromptOptions = NO_OPTIONS,
) -> SievedCache | None:
    """The cache every token of the prompt but the last is compressed into, or None where the module rule says so.

    `codec`: by default as the policy's storage says. `options`: `kvsieve.generate`'s `chunk`, `protect_positions`
    (over `input_ids`, the context) and `spans`.
    """
    codec = storage_codec(policy.storage, model) if codec is None else codec
    protect = protected_positions(options.protect_positions, input_ids.shape[-1])
    options = PromptOptions(options.chunk, protect, options.spans)
    context = int(real_tokens(input_ids, attention_mask).sum(dim=-1).min())
    if question_ids is None or question_ids.shape[-1] == 1:
        context -= 1  # the last token of the context is the one `generate` feeds first
    if not budget.is_size and context <= policy.n_sink + policy.n_recent:
        if codec.lossless or context < 1:
            return None
        budget = Rate(0.0)  # nothing to evict, but the entries are stored as asked
    if budget.is_size and context < 1:
        return None if buffer is None else bounded_cache_with(model, policy, budget, buffer, codec)
    settings = {"buffer": buffer, "attention_mask": attention_mask, "codec": codec, "tokenizer": tokenizer}
    if question_ids is not None and question_ids.shape[-1] > 1:
        settings |= options.up_to(input_ids.shape[-1])
        return compress_with(model, input_ids, policy, budget, question_ids=question_ids[:, :-1], **settings)
    ids, mask = prompt_with_question(input_ids, attention_mask, question_ids)
    settings["attention_mask"] = None if attention_mask is None else mask[:, :-1]
    return compress_with(model, ids[:, :-1], policy, budget, **settings, **options.up_to(ids.shape[-1] - 1))


def generate_compressed(
    model: torch.nn.Module,
    generate: Callable[..., torch.Tensor],
    input_ids: torch.Tensor,
    policy: Policy,
    budget: Budget,
    buffer: int | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    question_ids: torch.Tensor | None = None,
    codec: EntryCodec | None = None,
    options: PromptOptions = NO_OPTIONS,
    **generate_kwargs: object,
) -> tuple[torch.Tensor, SievedCache | None]:
    """Compress the prompt, then run `generate` (the model's own) from the cache under sieve attention.

    `buffer` (a size budget only) keeps the size while generating; `codec` stores the entries (by default as
    the policy's storage says); `options` go to the compression (`compressed_prompt`).
    Returns what `generate` returns (the prompt, then the new tokens) and the cache (None where the
    prompt was too short to evict, see the module docstring). A `tokenizer` among `generate_kwargs`
    (`model.generate` reads it for stop strings) also reaches the compression (``kvzip`` needs it; with
    ``projection=sentence`` and no `spans` it gives the prompt's sentences).
    """
    check_input_ids(model, input_ids)
    if question_ids is not None:
        check_input_ids(model, question_ids, "question_ids")
    tokenizer = generate_kwargs.get("tokenizer")
    if policy.needs_spans and options.spans is None and tokenizer is None:
        raise PolicyError(MISSING_SPANS)
    if buffer is not None and not budget.is_size:
        raise PolicyError(BUFFER_NEEDS_SIZE)
    bounded = "a bounded cache (max_tokens, max_bytes)"
    refuse_beams(model, generate_kwargs, bounded if buffer is not None else "a compressed cache")
    cache = compressed_prompt(
        model, input_ids, attention_mask, question_ids, policy, budget, buffer, codec, tokenizer, options
    )
    prompt, mask = prompt_with_question(input_ids, attention_mask, question_ids)
    with sieve_attention(model):
        return generate(prompt, attention_mask=mask, **cache_argument(model, cache), **generate_kwargs), cache
