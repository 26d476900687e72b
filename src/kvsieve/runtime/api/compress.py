"""`compress` a prompt into a `SievedCache`, or build an empty `bounded_cache` held at a size from its first token."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ...modeling.architecture import layer_windows
from ...selection.budget import Budget, Rate, SizeBudget, check_count, make_budget
from ...selection.errors import PolicyError
from ...selection.merge import Merged
from ...selection.policy import Policy
from ...selection.projection import MISSING_SPANS
from ...selection.protection import question_protection
from ...selection.spans import sentence_spans
from ...selection.spec import make_policy
from ..attention.sieve import sieve_attention
from ..compat import cache_argument
from ..eviction.growth import DEFAULT_BUFFER, BoundedGrowth
from ..inputs import check_input_ids, protected_positions
from ..observing.prefill import Prefill, observe_prefill
from ..observing.reconstruction import reconstruct
from ..storage.cache import SievedCache
from ..storage.codecs import EntryCodec, residual_nbytes, storage_codec, stored_entry_bytes

BUFFER_NEEDS_SIZE = "buffer and chunk bound a size budget (max_tokens or max_bytes); a rate has no size"
NOT_RECONSTRUCTED = (
    "kvzip scores entries by the model repeating its prompt, which is not defined for re-scoring during "
    "generation (buffer=): the text it would repeat is still being written. Use a rate or a size, with chunk= "
    "for a bounded prefill"
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _with_question(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    question_ids: torch.Tensor,
    n_recent: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The context followed by the question, and the positions to protect."""
    check_input_ids(model, question_ids, "question_ids")
    if question_ids.shape[0] != input_ids.shape[0]:
        raise ValueError(f"question_ids has {question_ids.shape[0]} rows, input_ids {input_ids.shape[0]}")
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("question-aware compression takes unpadded sequences; compress padded rows one at a time")
    protected = question_protection(input_ids.shape[-1], question_ids.shape[-1], n_recent)
    return torch.cat([input_ids, question_ids.to(input_ids.device)], dim=-1), protected.to(input_ids.device)


def compress(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    policy: str | Policy = "importance",
    rate: float | None = None,
    *,
    max_tokens: int | None = None,
    max_bytes: int | None = None,
    buffer: int | None = None,
    chunk: int | None = None,
    attention_mask: torch.Tensor | None = None,
    allocator: str | None = None,
    question_ids: torch.Tensor | None = None,
    protect_positions: Sequence[int] | torch.Tensor | None = None,
    spans: torch.Tensor | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    **policy_params: object,
) -> SievedCache:
    """Prefill `input_ids` and return a cache that holds what the budget allows of each sequence.

    The budget is one of: `rate`, the evicted fraction of each sequence's evictable entries
    (default 0.5); `max_tokens`, the entries each sequence keeps per (layer, kv-head) on average,
    protected ones included; `max_bytes`, the bytes of keys and values each sequence keeps. With
    `buffer`, a size budget also holds while the cache grows: decoding evicts back to it whenever
    `buffer` more tokens per (layer, kv-head) have come in (`kvsieve.runtime.eviction.growth`). With `chunk`,
    the prompt itself is prefilled `chunk` tokens at a time and evicted back to the size budget
    before each next chunk and after the last, so it never holds more than budget + chunk.

    The prefill runs on sieve attention (exact; the model's own attention comes back afterwards).
    Decode from the cache under `kvsieve.sieve_attention(model)`:
    `model.generate(torch.cat([input_ids, new_ids], -1), past_key_values=cache)`.

    Every sequence of a batch keeps its own entries, with its own budget counted over its own real
    tokens; padding is never kept. Question-agnostic (default): only the context is seen before
    eviction. Question-aware (`question_ids` given): context and question are prefilled together,
    so the question's queries feed the statistics (they are the last queries, the window scorers
    read); the question's entries are protected and stay in the cache, and so does the context's
    recent tail, so both modes evict the same number of context entries. Continue with
    `torch.cat([input_ids, question_ids, new_ids], -1)`.

    Args:
        input_ids: `[batch, tokens]`; pad with `attention_mask` (left or right padding).
        policy: a `Policy` or a spec such as ``"snapkv"``, ``"snapkv+adaptive:window=16"`` or
            ``"trimkv+global:kv_bits=4"`` (`kvsieve.make_policy`).
        rate: evicted fraction of the evictable entries, in [0, 1).
        max_tokens: entries kept per (layer, kv-head) on average; the allocator decides the split.
        max_bytes: bytes of keys and values kept per sequence (all layers).
        buffer: with a size budget, keep it during decoding: tokens per (layer, kv-head) the cache
            grows past it before it is evicted again (`kvsieve.runtime.eviction.growth.DEFAULT_BUFFER` is 64).
        chunk: with a size budget, prefill this many tokens at a time (unpadded prompts).
        attention_mask: `[batch, tokens]`, 1 for real tokens and 0 for padding.
        allocator: ``uniform``, ``pyramid``, ``adaptive`` or ``global``, if `policy` names none.
        question_ids: `[batch, q]` tokens of the question, for question-aware compression (unpadded rows).
        protect_positions: token positions (a list or 1-D tensor of ints, counted over each sequence's real
            tokens, each before the end of `input_ids`) never to evict.
        spans: the spans ``projection=sentence`` keeps whole: a span id (e.g. the sentence number,
            `kvsieve.sentence_spans`) per token position, `[tokens]` (counted over each
            sequence's real tokens, the same for every row) or `[batch, tokens]` (the shape of
            `input_ids`, padding columns ignored). Positions past the spans (a question, generated
            tokens) are spans of their own. Other projections ignore it. Not given, with a `tokenizer`:
            the sentences of `input_ids` (`kvsieve.sentence_spans(tokenizer, input_ids)`).
        tokenizer: the model's tokenizer, for a scorer that asks the model to repeat the prompt (``kvzip``)
            and for the sentences of ``projection=sentence`` when no `spans` are given.
        policy_params: scorer and allocator parameters, the protection (`n_sink`, `n_recent`), the
            projection (`projection`: ``topk``, ``chunk``, ``sentence``; `chunk_size` for ``chunk``,
            `best_tokens` for both) and the storage of the kept entries (`kvsieve.selection.storage.Storage`):
            `kv_bits` per number, 16 (the model's dtype), 8, 4 or 2 (integer codes, a scale and a minimum per
            `kv_group` channels, default 32), or `kv_codec="fp8"` (float8 e4m3, a scale per `kv_group`
            channels); the newest `kv_residual` (default 32) of every (row, kv-head) stay in full precision,
            and `max_bytes` counts the bytes as stored. The prefill and its scoring read the entries as
            computed; later forwards read them back decoded. The spec may say them too
            (``"snapkv:kv_bits=4"``); a value here that contradicts the spec's is an error.
    """
    budget = make_budget(rate, max_tokens, max_bytes)
    resolved = make_policy(policy, allocator, **policy_params)
    return compress_with(
        model,
        input_ids,
        resolved,
        budget,
        buffer=buffer,
        chunk=chunk,
        attention_mask=attention_mask,
        question_ids=question_ids,
        protect_positions=protect_positions,
        spans=spans,
        tokenizer=tokenizer,
    )


def compress_with(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    policy: Policy,
    budget: Budget,
    *,
    buffer: int | None = None,
    chunk: int | None = None,
    attention_mask: torch.Tensor | None = None,
    question_ids: torch.Tensor | None = None,
    protect_positions: Sequence[int] | torch.Tensor | None = None,
    spans: torch.Tensor | None = None,
    codec: EntryCodec | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> SievedCache:
    """`compress` with the policy and the budget already built (`make_policy`, `make_budget`); `codec`: how the
    entries are stored (`storage_codec`), by default as the policy's storage says."""
    check_input_ids(model, input_ids)
    codec = storage_codec(policy.storage, model) if codec is None else codec
    protect_positions = protected_positions(protect_positions, input_ids.shape[-1])
    refuse_unevictable(model, budget)
    if spans is None and tokenizer is not None and policy.reads_spans:
        spans = sentence_spans(tokenizer, input_ids)
    row_spans = spans_per_row(spans, input_ids, attention_mask)
    if policy.needs_spans and row_spans is None:
        raise PolicyError(MISSING_SPANS)
    if question_ids is not None:
        input_ids, protected = _with_question(model, input_ids, attention_mask, question_ids, policy.n_recent)
        protect_positions = (
            protected if protect_positions is None else torch.cat([protect_positions.to(protected.device), protected])
        )
        attention_mask = None
    growth = None
    if chunk is not None or buffer is not None:
        _check_bounded(budget, buffer, chunk, attention_mask, protect_positions, spans)
        if buffer is not None and policy.needs.reconstruction is not None:
            raise PolicyError(NOT_RECONSTRUCTED)
        growth = BoundedGrowth.of(policy, budget, chunk or buffer, model, protect_positions, row_spans)
        policy = growth.policy  # without the merge its gates' checkpoint may record
    first = input_ids if chunk is None else input_ids[:, :chunk]
    prefill = observe_prefill(model, first, policy.needs, attention_mask=attention_mask, tokenizer=tokenizer)
    if growth is not None:
        growth.start(prefill)
    kept, merged = _kept_per_row(prefill, policy, budget, protect_positions, row_spans, codec, growth is not None)
    cache = prefill.cache.keep(kept, codec=codec)
    cache.merge(merged)
    if growth is not None:
        growth.evicted(cache)
        if chunk is not None and input_ids.shape[1] > chunk:
            _feed_chunks(model, cache, growth, input_ids, chunk, tokenizer)
        cache.growth = None if buffer is None else dataclasses.replace(growth, buffer=buffer)
    return cache


def _kept_per_row(
    prefill: Prefill,
    policy: Policy,
    limit: Budget,
    protect: torch.Tensor | None,
    spans: Sequence[torch.Tensor] | None,
    codec: EntryCodec,
    bounded: bool = False,
) -> tuple[list[list[list[torch.Tensor]]], list[list[Merged] | None]]:
    """Stored indices every row of `prefill` keeps, and what it merges (`Policy.merged`); a policy error names the
    row of a batch.

    A byte budget pays for the sliding-window layers' windows and the codec's full-precision residuals
    first (`Budget.reserve`) and counts entries as `codec` stores them. `spans`: each row's span ids
    over its real tokens (`spans_per_row`). `bounded`: the cache will be held at the budget as it grows,
    and this is its first eviction (`Observation.bounded`).
    """
    keep, merged = [], []
    for row, observations in enumerate(prefill.observations):
        observations = [dataclasses.replace(o, bounded=bounded) for o in observations]
        try:
            row_spans = None if spans is None else spans[row]
            budget = limit.reserve(prefill.cache.window_nbytes() + residual_nbytes(codec, observations))
            stored = stored_entry_bytes(codec, observations)
            kept = policy.select(observations, budget, protect, row_spans, stored)
        except PolicyError as err:
            if len(prefill.observations) == 1:
                raise
            raise PolicyError(f"sequence {row} of the batch: {err}") from None
        keep.append(prefill.stored(row, kept))
        merged.append(policy.merged(observations, kept))
    return keep, merged


def spans_per_row(
    spans: torch.Tensor | None, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> list[torch.Tensor] | None:
    """Each sequence's span ids over its real tokens, from `compress`'s `spans` (`[tokens]` or `[batch, tokens]`)."""
    if spans is None:
        return None
    if not isinstance(spans, torch.Tensor) or spans.is_floating_point() or spans.dtype == torch.bool:
        raise PolicyError("spans must be an integer tensor: a span id per token position")
    if spans.ndim == 1:
        return [spans] * input_ids.shape[0]
    if spans.shape != input_ids.shape:
        raise PolicyError(
            f"spans must have shape [tokens] or the shape of input_ids {tuple(input_ids.shape)}, "
            f"got {tuple(spans.shape)}"
        )
    if attention_mask is None:
        return list(spans)
    return [row[real.to(row.device).bool()] for row, real in zip(spans, attention_mask, strict=True)]


def refuse_unevictable(model: torch.nn.Module, budget: Budget) -> None:
    """A clear error when a budget asks to evict from a model whose every layer keeps its own sliding window."""
    windows = layer_windows(model)
    if None in windows or budget == Rate(0.0):
        return
    raise PolicyError(
        f"nothing to evict: every layer of {type(model).__name__} is a sliding-window layer "
        f"(sliding_window={windows[0]}), whose cache already holds at most the last {windows[0] - 1} tokens per "
        "(layer, kv-head) and is never evicted by a policy; kvsieve evicts full-attention layers. Use rate=0 to "
        "keep the windows as they are, or the model's own cache"
    )


def _check_bounded(
    budget: Budget,
    buffer: int | None,
    chunk: int | None,
    attention_mask: torch.Tensor | None,
    protect: object,
    spans: object = None,
) -> None:
    """A clear error for a buffer or a chunked prefill that cannot be honoured."""
    if not budget.is_size:
        raise PolicyError(BUFFER_NEEDS_SIZE)
    if chunk is not None:
        check_count("chunk", chunk)
    padded = attention_mask is not None and not bool(attention_mask.bool().all())
    if padded and chunk is not None:
        raise PolicyError("a chunked prefill takes unpadded prompts; compress padded rows one at a time")
    if padded and protect is not None:
        raise PolicyError(
            "protect_positions with a buffer take unpadded prompts (positions stay protected during generation, "
            "and padding shifts them per row); compress padded rows one at a time"
        )
    if padded and spans is not None:
        raise PolicyError(
            "spans with a buffer take unpadded prompts (they are read again at every eviction during generation, "
            "and padding shifts positions per row); compress padded rows one at a time"
        )


@torch.no_grad()
def _feed_chunks(
    model: torch.nn.Module,
    cache: SievedCache,
    growth: BoundedGrowth,
    input_ids: torch.Tensor,
    chunk: int,
    tokenizer: PreTrainedTokenizerBase | None,
) -> None:
    """Feed `input_ids` after its first `chunk` tokens (in `cache` already) `chunk` tokens at a time: before a
    chunk that would take the cache past budget + chunk, and after the last, `growth` evicts it back to the budget.

    The evictions happen here, between the forwards, rather than from the cache's append hook: a policy that
    scores by the model repeating its prompt (kvzip) runs a forward for each, and a forward cannot run inside
    another. The hook stays set while feeding, for what the scorer reads (recent queries, attention sums)."""
    n = input_ids.shape[1]
    cache.growth = growth
    with sieve_attention(model):
        for start in range(chunk, n, chunk):
            end = min(start + chunk, n)
            if growth.overflows(cache, end - start):
                evict_between_forwards(model, cache, growth, input_ids[:, :start], tokenizer)
            model(input_ids=input_ids[:, start:end], **cache_argument(model, cache), use_cache=True, logits_to_keep=1)
        evict_between_forwards(model, cache, growth, input_ids, tokenizer)


def evict_between_forwards(
    model: torch.nn.Module,
    cache: SievedCache,
    growth: BoundedGrowth,
    fed: torch.Tensor,
    tokenizer: PreTrainedTokenizerBase | None,
) -> None:
    """Evict `cache` back to `growth`'s budget between two forwards (a chunked prefill, `lm-eval`'s rolling
    stream); a policy that reads the model repeating its prompt (kvzip) has it repeat every token `fed` so far
    after what the cache holds first."""
    needs = growth.policy.needs.reconstruction
    growth.evict(cache, None if needs is None else reconstruct(model, cache, fed, needs, tokenizer))


def bounded_cache(
    model: torch.nn.Module,
    policy: str | Policy = "streaming",
    *,
    max_tokens: int | None = None,
    max_bytes: int | None = None,
    buffer: int = DEFAULT_BUFFER,
    allocator: str | None = None,
    **policy_params: object,
) -> SievedCache:
    """An empty cache that holds a size budget from its first token on: feed it a stream of any length.

    Feed it under `kvsieve.sieve_attention(model)` (`model.generate(ids, past_key_values=cache)`, or
    forwards of chunks of a long document): before a forward would take a sequence past the budget
    plus `buffer` entries per (layer, kv-head) on average, every layer is evicted back to the budget.
    Forwards of `buffer` tokens each therefore evict exactly where token-by-token decoding would
    when the budget is a multiple of `buffer`; a longer forward takes the cache past budget + buffer
    by the difference until the next eviction.

    Args:
        policy, allocator, policy_params: as for `compress` (the storage keys included: entries are stored
            so from the first token).
        max_tokens, max_bytes: the size (one of them), as for `compress`.
        buffer: entries per (layer, kv-head) the cache grows past the budget before it is evicted.
    """
    if max_tokens is None and max_bytes is None:
        raise PolicyError("a bounded cache needs a size: max_tokens or max_bytes")
    resolved = make_policy(policy, allocator, **policy_params)
    budget = make_budget(None, max_tokens, max_bytes)
    return bounded_cache_with(model, resolved, budget, buffer)


def bounded_cache_with(
    model: torch.nn.Module, policy: Policy, budget: SizeBudget, buffer: int, codec: EntryCodec | None = None
) -> SievedCache:
    """`bounded_cache` with the policy and the size already built; `codec` as for `compress_with`."""
    refuse_unevictable(model, budget)
    cache = SievedCache.for_model(model, storage_codec(policy.storage, model) if codec is None else codec)
    cache.growth = BoundedGrowth.of(policy, budget, buffer, model)
    return cache
