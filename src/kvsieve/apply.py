"""User-facing entry points: `compress` a context, or `apply` a policy to every `generate()` call."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

import torch

from .attention import sieve_attention
from .budget import Budget, Rate, as_budget, check_count, make_budget
from .cache import SievedCache
from .errors import PolicyError
from .growth import DEFAULT_BUFFER, BoundedGrowth
from .observe import Observation, Prefill, check_input_ids, observe_prefill
from .policy import DEFAULT_N_SINK, DEFAULT_SLIDING_WINDOW, Policy, make_policy
from .projection import MISSING_SPANS
from .sliding import layer_windows


def question_protection(n_context: int, n_question: int, sliding_window: int) -> torch.Tensor:
    """Positions protected in question-aware compression: the question and the context's own recent window.

    Protecting the context's last `sliding_window` tokens as the agnostic case does makes both
    modes evict the same number of context entries.
    """
    return torch.arange(max(0, n_context - sliding_window), n_context + n_question)


def _with_question(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    question_ids: torch.Tensor,
    sliding_window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The context followed by the question, and the positions to protect."""
    check_input_ids(model, question_ids, "question_ids")
    if question_ids.shape[0] != input_ids.shape[0]:
        raise ValueError(f"question_ids has {question_ids.shape[0]} rows, input_ids {input_ids.shape[0]}")
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("question-aware compression takes unpadded sequences; compress padded rows one at a time")
    protected = question_protection(input_ids.shape[-1], question_ids.shape[-1], sliding_window)
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
    budget: str | None = None,
    question_ids: torch.Tensor | None = None,
    protect_positions: torch.Tensor | None = None,
    spans: torch.Tensor | None = None,
    **policy_params: object,
) -> SievedCache:
    """Prefill `input_ids` and return a cache that holds what the budget allows of each sequence.

    The budget is one of: `rate`, the evicted fraction of each sequence's evictable entries
    (default 0.5); `max_tokens`, the entries each sequence keeps per (layer, kv-head) on average,
    protected ones included; `max_bytes`, the bytes of keys and values each sequence keeps. With
    `buffer`, a size budget also holds while the cache grows: decoding evicts back to it whenever
    `buffer` more tokens per (layer, kv-head) have come in (`kvsieve.growth`). With `chunk`, the
    prompt itself is prefilled `chunk` tokens at a time and evicted back to the size budget
    before each next chunk and after the last, so it never holds more than budget + chunk.

    The prefill runs on sieve attention (exact; the model's own attention comes back afterwards).
    Decode from the cache under `kvsieve.sieve_attention(model)`:
    `model.generate(torch.cat([input_ids, new_ids], -1), past_key_values=cache)`.

    Every sequence of a batch keeps its own entries, with its own budget counted over its own real
    tokens; padding is never kept. Question-agnostic (default): only the context is seen before
    eviction. Question-aware (`question_ids` given): context and question are prefilled together,
    so the question's queries feed the statistics (they are the last queries, the window scorers
    read); the question's entries are protected and stay in the cache, and so does the context's
    recent window, so both modes evict the same number of context entries. Continue with
    `torch.cat([input_ids, question_ids, new_ids], -1)`.

    Args:
        input_ids: `[batch, tokens]`; pad with `attention_mask` (left or right padding).
        policy: a `Policy` or a spec such as ``"snapkv"`` or ``"snapkv+adaptive:window=16"``.
        rate: evicted fraction of the evictable entries, in [0, 1).
        max_tokens: entries kept per (layer, kv-head) on average; the allocator decides the split.
        max_bytes: bytes of keys and values kept per sequence (all layers).
        buffer: with a size budget, keep it during decoding: tokens per (layer, kv-head) the cache
            grows past it before it is evicted again (`kvsieve.growth.DEFAULT_BUFFER` is 64).
        chunk: with a size budget, prefill this many tokens at a time (unpadded prompts).
        attention_mask: `[batch, tokens]`, 1 for real tokens and 0 for padding.
        budget: the allocator (``uniform``, ``pyramid``, ``adaptive``, ``global``) if `policy` names none.
        question_ids: `[batch, q]` tokens of the question, for question-aware compression (unpadded rows).
        protect_positions: token positions (counted over each sequence's real tokens) never to evict.
        spans: the spans ``projection=sentence`` keeps whole: a span id (e.g. the sentence number,
            `kvsieve.sentence_spans`) per token position, `[tokens]` (counted over each
            sequence's real tokens, the same for every row) or `[batch, tokens]` (the shape of
            `input_ids`, padding columns ignored). Positions past the spans (a question, generated
            tokens) are spans of their own. Other projections ignore it.
        policy_params: scorer and allocator parameters, `n_sink` / `sliding_window` and the
            projection (`projection`: ``topk``, ``chunk``, ``sentence``; `chunk_size` for ``chunk``).
    """
    limit = make_budget(rate, max_tokens, max_bytes)
    resolved = make_policy(policy, budget=budget, **policy_params)
    check_input_ids(model, input_ids)
    refuse_unevictable(model, limit)
    row_spans = spans_per_row(spans, input_ids, attention_mask)
    if resolved.projector.needs_spans and row_spans is None:
        raise PolicyError(MISSING_SPANS)
    if question_ids is not None:
        input_ids, protected = _with_question(model, input_ids, attention_mask, question_ids, resolved.sliding_window)
        protect_positions = protected if protect_positions is None else torch.cat([protect_positions, protected])
        attention_mask = None
    growth = None
    if chunk is not None or buffer is not None:
        sized = max_tokens is not None or max_bytes is not None
        _check_bounded(sized, buffer, chunk, attention_mask, protect_positions, spans)
        growth = BoundedGrowth.of(resolved, limit, chunk or buffer, model, protect_positions, row_spans)
    first = input_ids if chunk is None else input_ids[:, :chunk]
    prefill = observe_prefill(model, first, resolved.needs, attention_mask=attention_mask)
    if growth is not None:
        growth.start(prefill)
    cache = prefill.cache.keep(_keep_rows(prefill, resolved, limit, protect_positions, row_spans))
    if growth is not None:
        if chunk is not None and input_ids.shape[1] > chunk:
            _feed_chunks(model, cache, growth, input_ids[:, chunk:], chunk)
        cache.growth = None if buffer is None else dataclasses.replace(growth, buffer=buffer)
    return cache


def _keep_rows(
    prefill: Prefill,
    policy: Policy,
    limit: Budget,
    protect: torch.Tensor | None,
    spans: Sequence[torch.Tensor] | None = None,
) -> list[list[list[torch.Tensor]]]:
    """Stored indices every row of `prefill` keeps; a policy error names the row of a batch.

    A byte budget pays for the sliding-window layers' windows first (`Budget.reserve`). `spans`:
    each row's span ids over its real tokens (`spans_per_row`).
    """
    limit = limit.reserve(prefill.cache.window_nbytes())
    keep = []
    for row, observations in enumerate(prefill.observations):
        try:
            row_spans = None if spans is None else spans[row]
            keep.append(prefill.stored(row, policy.keep_indices(observations, limit, protect, row_spans)))
        except PolicyError as err:
            if len(prefill.observations) == 1:
                raise
            raise PolicyError(f"sequence {row} of the batch: {err}") from None
    return keep


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
    sized: bool,
    buffer: int | None,
    chunk: int | None,
    attention_mask: torch.Tensor | None,
    protect: object,
    spans: object = None,
) -> None:
    """A clear error for a buffer or a chunked prefill that cannot be honoured."""
    if not sized:
        raise PolicyError("buffer and chunk bound a size budget (max_tokens or max_bytes); a rate has no size")
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
    model: torch.nn.Module, cache: SievedCache, growth: BoundedGrowth, rest: torch.Tensor, chunk: int
) -> None:
    """Feed `rest` `chunk` tokens at a time; `growth` evicts to the budget before each chunk and after the last."""
    cache.growth = growth
    with sieve_attention(model):
        for start in range(0, rest.shape[1], chunk):
            model(input_ids=rest[:, start : start + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
    growth.evict(cache)


def bounded_cache(
    model: torch.nn.Module,
    policy: str | Policy = "streaming",
    *,
    max_tokens: int | None = None,
    max_bytes: int | None = None,
    buffer: int = DEFAULT_BUFFER,
    budget: str | None = None,
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
        policy, budget, policy_params: as for `compress`.
        max_tokens, max_bytes: the size (one of them), as for `compress`.
        buffer: entries per (layer, kv-head) the cache grows past the budget before it is evicted.
    """
    if max_tokens is None and max_bytes is None:
        raise PolicyError("a bounded cache needs a size: max_tokens or max_bytes")
    limit = make_budget(None, max_tokens, max_bytes)
    resolved = make_policy(policy, budget=budget, **policy_params)
    refuse_unevictable(model, limit)
    cache = SievedCache.for_model(model)
    cache.growth = BoundedGrowth.of(resolved, limit, buffer, model)
    return cache


def compress_prompt(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    policy: str | Policy,
    rate: float | None = None,
    question_ids: torch.Tensor | None = None,
    **budget: int | None,
) -> SievedCache:
    """`compress` every token of a prompt but the last, which `generate` then feeds first.

    The prompt is `input_ids`, followed by `question_ids` if given: then the compression is
    question-aware (the question is protected, also while a size budget holds during generation).
    `budget`: `max_tokens`, `max_bytes` and `buffer`, as for `compress`.
    """
    if question_ids is not None and question_ids.shape[-1] > 1:
        question = question_ids[:, :-1]
        return compress(model, input_ids, policy, rate, attention_mask=attention_mask, question_ids=question, **budget)
    if question_ids is not None:  # a one-token question is the token `generate` feeds first
        input_ids, attention_mask = prompt_with_question(input_ids, attention_mask, question_ids)
    context_mask = None if attention_mask is None else attention_mask[:, :-1]
    return compress(model, input_ids[:, :-1], policy, rate, attention_mask=context_mask, **budget)


def prompt_with_question(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, question_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The whole prompt `generate` reads: the context, then the question (and the mask extended over it)."""
    ids = torch.cat([input_ids, question_ids.to(input_ids.device)], dim=-1)
    if attention_mask is None:
        return ids, None
    return ids, torch.cat([attention_mask, torch.ones_like(question_ids, device=attention_mask.device)], dim=-1)


def refuse_beams(model: torch.nn.Module, generate_kwargs: dict, what: str) -> None:
    """A clear error if `generate` would run beam search (asked for, or the model's generation config)."""
    if int(generate_kwargs.get("num_beams") or model.generation_config.num_beams or 1) > 1:
        raise PolicyError(f"beam search cannot run on {what}; use greedy decoding or sampling")


@dataclass(frozen=True)
class Eviction:
    """One eviction of a prefill: a policy (None: keep everything), a budget (a rate, or `kvsieve.budget`'s
    `MaxTokens` / `MaxBytes`), positions never to evict and the sequence's spans (`[n_tokens]`, a span id
    per token position, for ``projection=sentence``; see `Policy.keep_indices`)."""

    policy: str | Policy | None
    budget: float | Budget = 0.0
    protect_positions: torch.Tensor | None = None
    spans: torch.Tensor | None = None

    def keep_indices(self, observations: Sequence[Observation], reserved: int = 0) -> list[list[torch.Tensor]]:
        """Per observed layer and kv-head, the entries to keep; `reserved`: bytes per sequence of the
        sliding-window layers at their window, which a byte budget sets aside first."""
        if self.policy is None:
            return [[torch.arange(o.length) for _ in range(o.num_kv_heads)] for o in observations]
        budget = as_budget(self.budget).reserve(reserved)
        return make_policy(self.policy).keep_indices(observations, budget, self.protect_positions, self.spans)


class EvictionPlan(Protocol):
    """Anything that says which observed entries of one sequence to keep (`Eviction`, or a variant of one)."""

    def keep_indices(self, observations: Sequence[Observation], reserved: int = 0) -> list[list[torch.Tensor]]: ...


def evictions(prefill: Prefill, plans: Sequence[EvictionPlan], row: int = 0) -> SievedCache:
    """One cache whose row `i` is sequence `row` of `prefill` evicted by `plans[i]`.

    "Prefill once, sieve many" in one batch: a sweep decodes every (policy, rate) of a sample in
    one batched pass. The prefill's own cache is left as it is.
    """
    reserved = prefill.cache.window_nbytes()
    keep = [prefill.stored(row, plan.keep_indices(prefill.observations[row], reserved)) for plan in plans]
    return prefill.cache.keep(keep, rows=[row] * len(keep))


@dataclass(frozen=True)
class EvictionConfig:
    """The one-call configuration: a policy and a budget for every prompt `generate()` sees.

    The budget is `eviction_rate` (default 0.5) of each prompt's evictable entries, or a size:
    `max_tokens` per (layer, kv-head) on average, or `max_bytes` per sequence. A size also holds
    during generation: the cache is evicted back to it whenever it has grown by `buffer` tokens
    per (layer, kv-head). `eviction_mode` is a policy spec (scorer, optionally `+allocator` and
    parameters); `budget` names the allocator when the spec does not.
    """

    eviction_rate: float | None = None
    eviction_mode: str = "importance"
    budget: str | None = None
    n_sink: int = DEFAULT_N_SINK
    sliding_window: int = DEFAULT_SLIDING_WINDOW
    max_tokens: int | None = None
    max_bytes: int | None = None
    buffer: int = DEFAULT_BUFFER

    def __post_init__(self) -> None:
        make_budget(self.eviction_rate, self.max_tokens, self.max_bytes)
        if self.policy().projector.needs_spans:  # also validates the mode and the protection
            raise PolicyError(
                f"eviction_mode {self.eviction_mode!r}: projection=sentence needs spans, which generate() cannot "
                "take; use kvsieve.compress(..., spans=...) and decode from its cache"
            )
        if self.sized:
            check_count("buffer", self.buffer)

    @property
    def sized(self) -> bool:
        """Whether the budget is a size (and so bounds generation)."""
        return self.max_tokens is not None or self.max_bytes is not None

    def policy(self) -> Policy:
        return make_policy(
            self.eviction_mode, budget=self.budget, n_sink=self.n_sink, sliding_window=self.sliding_window
        )


class SieveHandle:
    """Returned by `apply`: while active, `model.generate()` compresses each prompt first.

    The model runs on sieve attention while the handle is active. Each prompt minus its last
    token is prefilled and compressed (every row of a batch with its own budget; pass the
    `attention_mask` of a padded batch); `generate` then feeds the last token and decodes from
    the compressed cache, which a size budget keeps bounded however long the generation.
    Question-aware: `model.generate(context_ids, question_ids=question, ...)` compresses the
    context after the question is seen and keeps the question (and the context's recent window)
    protected; the output starts with the context and the question. Under a rate, prompts with
    nothing evictable are not compressed. `last_cache` is the cache of the latest call.
    `remove()` (or leaving the with-block) gives the model back its own `generate` and attention.
    """

    def __init__(self, model: torch.nn.Module, config: EvictionConfig) -> None:
        self.model = model
        self.config = config
        self.last_cache: SievedCache | None = None
        self._policy = config.policy()
        self._scope = ExitStack()
        self._scope.enter_context(sieve_attention(model))
        original = model.generate

        @functools.wraps(original)
        def generate(*args: object, **kwargs: object) -> torch.Tensor:
            return self._generate(original, *args, **kwargs)

        model.generate = generate
        self._scope.callback(model.__dict__.pop, "generate", None)

    def _generate(self, original: object, inputs: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor:
        input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
        question = kwargs.pop("question_ids", None)
        if kwargs.get("past_key_values") is not None or not isinstance(input_ids, torch.Tensor):
            if question is not None:
                raise ValueError("question_ids go with a prompt (input_ids) and no past_key_values")
            return original(input_ids, **kwargs)
        config = self.config
        if config.sized:
            refuse_beams(self.model, kwargs, "a bounded cache (max_tokens, max_bytes)")
        mask = kwargs.get("attention_mask")
        prompt, prompt_mask = (input_ids, mask) if question is None else prompt_with_question(input_ids, mask, question)
        shortest = prompt.shape[-1] - 1 if prompt_mask is None else int(prompt_mask[:, :-1].sum(dim=-1).min())
        if shortest > (0 if config.sized else self._policy.n_sink + self._policy.sliding_window):
            cache = compress_prompt(
                self.model,
                input_ids,
                mask,
                self._policy,
                config.eviction_rate,
                question,
                max_tokens=config.max_tokens,
                max_bytes=config.max_bytes,
                buffer=config.buffer if config.sized else None,
            )
            kwargs["past_key_values"] = self.last_cache = cache
        if prompt_mask is not None:
            kwargs["attention_mask"] = prompt_mask
        return original(prompt, **kwargs)

    def remove(self) -> None:
        """Restore the model's own `generate` and attention."""
        self._scope.close()

    def __enter__(self) -> SieveHandle:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()


def apply(model: torch.nn.Module, config: EvictionConfig) -> SieveHandle:
    """From now on `model.generate()` compresses every prompt with `config` (see `SieveHandle`)."""
    if not isinstance(config, EvictionConfig):
        raise TypeError(f"apply() takes an EvictionConfig, got {type(config).__name__}")
    if "generate" in model.__dict__:
        raise RuntimeError("a kvsieve policy (or another wrapper) is already applied to this model; remove() it first")
    return SieveHandle(model, config)
