"""`kvsieve.generate`: compress and generate in one call, or continue a compressed cache from the new tokens only."""

from __future__ import annotations

import torch

from ..selection.budget import make_budget
from ..selection.errors import PolicyError
from ..selection.policy import Policy
from ..selection.spec import make_policy
from .attention import sieve_attention
from .cache import SievedCache
from .codecs import Storage
from .decoding import generate_compressed, refuse_beams
from .inputs import check_input_ids


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
    question_ids: torch.Tensor | None = None,
    kv_bits: int = 16,
    kv_group: int | None = None,
    kv_residual: int | None = None,
    **generate_kwargs: object,
) -> torch.Tensor:
    """Generate from a compressed cache under sieve attention.

    Without `cache`: everything but the last token of the prompt `input_ids` is compressed with
    `policy` and the budget (as `kvsieve.compress`; with `buffer`, a size budget also holds while
    generating), then `model.generate` runs; returns the prompt followed by the new tokens. With
    `question_ids` the prompt is `input_ids` then the question, compressed question-aware (the
    question stays protected); `kv_bits`, `kv_group`, `kv_residual` store the entries as `compress` does. The rule
    for prompts too short to evict is `kvsieve.apply`'s
    (`kvsieve.runtime.decoding`): under a rate they are generated from the model's own cache.

    With `cache` (from `kvsieve.compress`, one sequence): `input_ids` `[1, n]` are only the tokens
    after what the cache has seen (at least one: the next token to feed); returns them followed by
    the new tokens. The cache is extended in place. Logits processors that read earlier tokens
    (repetition penalties) see placeholders for the tokens only the cache holds.

    `generate_kwargs` go to `model.generate` (`max_new_tokens`, `do_sample`, ...); beam search
    cannot run on a compressed cache.
    """
    if cache is None:
        budget = make_budget(rate, max_tokens, max_bytes)
        out, _ = generate_compressed(
            model,
            model.generate,
            input_ids,
            make_policy(policy),
            budget,
            buffer,
            attention_mask=attention_mask,
            question_ids=question_ids,
            codec=Storage(kv_bits, kv_group, kv_residual).codec(model),
            **generate_kwargs,
        )
        return out
    check_input_ids(model, input_ids)
    refuse_beams(model, generate_kwargs, "a compressed cache")
    given = (attention_mask, rate, max_tokens, max_bytes, question_ids, kv_group, kv_residual)
    if any(value is not None for value in given) or kv_bits != 16:
        raise PolicyError(
            "with a cache, give only the new tokens: its budget, padding and storage were set by compress"
        )
    if cache.batch_size != 1 or input_ids.shape[0] != 1:
        raise ValueError(
            "new tokens alone continue a cache of one sequence; for a batch (rows may be padded), call "
            "model.generate with the whole sequences, their attention_mask and past_key_values=cache"
        )
    seen = cache.get_seq_length()
    placeholders = input_ids.new_zeros(input_ids.shape[0], seen)  # held by the cache, never fed
    full = torch.cat([placeholders, input_ids], dim=-1)
    with sieve_attention(model):
        out = model.generate(full, attention_mask=torch.ones_like(full), past_key_values=cache, **generate_kwargs)
    return out[:, seen:]
