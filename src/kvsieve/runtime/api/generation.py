"""`kvsieve.generate`: compress and generate in one call, or continue a compressed cache from the new tokens only."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...selection.budget import make_budget
from ...selection.errors import PolicyError
from ...selection.policy import Policy
from ...selection.spec import make_policy, policy_keywords
from ..attention.sieve import sieve_attention
from ..compat import cache_argument
from ..inputs import check_input_ids
from ..storage.cache import SievedCache
from .decoding import PromptOptions, generate_compressed, refuse_beams


def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    policy: str | Policy = "importance",
    rate: float | None = None,
    *,
    cache: SievedCache | None = None,
    attention_mask: torch.Tensor | None = None,
    max_tokens: int | None = None,
    max_bytes: int | None = None,
    buffer: int | None = None,
    chunk: int | None = None,
    allocator: str | None = None,
    question_ids: torch.Tensor | None = None,
    protect_positions: Sequence[int] | torch.Tensor | None = None,
    spans: torch.Tensor | None = None,
    **kwargs: object,
) -> torch.Tensor:
    """Generate from a compressed cache under sieve attention.

    Without `cache`: everything but the last token of the prompt `input_ids` is compressed with
    `policy` and the budget, with `kvsieve.compress`'s keywords (`allocator`, `chunk`, `protect_positions`,
    `spans`, and policy parameters such as `window=16` or the storage keys `kv_bits`, `kv_codec`, ...;
    with `buffer`, a size budget also holds while generating), then `model.generate` runs; returns the
    prompt followed by the new tokens. With `question_ids` the prompt is `input_ids` then the question,
    compressed question-aware (the question stays protected). The rule for prompts too short to evict is
    `kvsieve.apply`'s (`kvsieve.runtime.api.decoding`): under a rate they are generated from the model's own cache.

    With `cache` (from `kvsieve.compress`, one sequence): `input_ids` `[1, n]` are only the tokens
    after what the cache has seen (at least one: the next token to feed); returns them followed by
    the new tokens. The cache is extended in place. Logits processors that read earlier tokens
    (repetition penalties) see placeholders for the tokens only the cache holds.

    The other `kwargs` go to `model.generate` (`max_new_tokens`, `do_sample`, ...), which refuses a name it
    does not know; a `tokenizer` goes to both (``kvzip`` and stop strings read it). Beam search cannot
    run on a compressed cache.
    """
    params = {key: kwargs.pop(key) for key in list(kwargs) if key in policy_keywords()}
    if params.get("kv_bits") == 16:  # the model's own dtype: what no storage key says
        del params["kv_bits"]
    if cache is not None:
        compression = {
            "policy": None if policy == "importance" else policy,
            "rate": rate,
            "attention_mask": attention_mask,
            "max_tokens": max_tokens,
            "max_bytes": max_bytes,
            "buffer": buffer,
            "chunk": chunk,
            "allocator": allocator,
            "question_ids": question_ids,
            "protect_positions": protect_positions,
            "spans": spans,
        }
        given = [key for key, value in (compression | params).items() if value is not None]
        return _continue(model, input_ids, cache, given, kwargs)
    out, _ = generate_compressed(
        model,
        model.generate,
        input_ids,
        make_policy(policy, allocator, **params),
        make_budget(rate, max_tokens, max_bytes),
        buffer,
        attention_mask=attention_mask,
        question_ids=question_ids,
        options=PromptOptions(chunk, protect_positions, spans),
        **kwargs,
    )
    return out


def _continue(
    model: torch.nn.Module, input_ids: torch.Tensor, cache: SievedCache, given: list[str], generate_kwargs: dict
) -> torch.Tensor:
    """`generate` from `cache` and the new tokens `input_ids`; `given`: the compression keywords passed (refused)."""
    check_input_ids(model, input_ids)
    refuse_beams(model, generate_kwargs, "a compressed cache")
    if given:
        raise PolicyError(
            f"with a cache, give only the new tokens: its policy, budget, padding and storage were set by compress "
            f"(got {', '.join(given)})"
        )
    if cache.batch_size != 1 or input_ids.shape[0] != 1:
        raise ValueError(
            "new tokens alone continue a cache of one sequence; for a batch (rows may be padded), call "
            "model.generate with the whole sequences, their attention_mask and the cache"
        )
    seen = cache.get_seq_length()
    placeholders = input_ids.new_zeros(input_ids.shape[0], seen)  # held by the cache, never fed
    full = torch.cat([placeholders, input_ids], dim=-1)
    with sieve_attention(model):
        out = model.generate(
            full, attention_mask=torch.ones_like(full), **cache_argument(model, cache), **generate_kwargs
        )
    if isinstance(out, torch.Tensor):
        return out[:, seen:]
    out.sequences = out.sequences[:, seen:]  # return_dict_in_generate: scores and the rest cover new tokens only
    return out
