"""User-facing entry points: `compress` a context, or `apply` a policy to every `generate()` call."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import TracebackType

import torch

from .cache import SievedCache
from .observe import observe_prefill
from .policy import Policy, check_rate, make_policy


def question_protection(n_context: int, n_question: int, sliding_window: int) -> torch.Tensor:
    """Positions protected in question-aware compression: the question and the context's own recent window.

    Protecting the context's last `sliding_window` tokens as the agnostic case does makes both
    modes evict the same number of context entries.
    """
    return torch.arange(max(0, n_context - sliding_window), n_context + n_question)


def compress(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    policy: str | Policy = "importance",
    rate: float = 0.5,
    *,
    budget: str | None = None,
    question_ids: torch.Tensor | None = None,
    protect_positions: torch.Tensor | None = None,
    **policy_params: object,
) -> SievedCache:
    """Prefill `input_ids` ([1, tokens]) and return a cache from which `rate` of the evictable entries are gone.

    The model is switched to sieve attention (exact; identical to SDPA for ordinary caches).
    Continue with `model.generate(torch.cat([input_ids, new_ids], -1), past_key_values=cache)`.

    Question-agnostic (default): only the context is seen before eviction. Question-aware
    (`question_ids` given): the context and the question are prefilled together, so the
    question's queries feed the statistics (they are the last queries, the window scorers
    read); the question's entries are protected and stay in the cache, and so does the
    context's recent window, so both modes evict the same number of context entries. Continue with
    `torch.cat([input_ids, question_ids, new_ids], -1)`.

    Args:
        policy: a `Policy` or a spec such as ``"snapkv"`` or ``"snapkv+adaptive:window=16"``.
        rate: evicted fraction of the evictable entries, in [0, 1).
        budget: the allocator (``uniform``, ``pyramid``, ``adaptive``, ``global``) if `policy` names none.
        question_ids: `[1, q]` tokens of the question, for question-aware compression.
        protect_positions: positions never to evict.
        policy_params: scorer and allocator parameters and `n_sink` / `sliding_window`.
    """
    rate = check_rate(rate)
    resolved = make_policy(policy, budget=budget, **policy_params)
    if question_ids is not None:
        if not isinstance(question_ids, torch.Tensor) or question_ids.ndim != 2 or question_ids.shape[0] != 1:
            raise ValueError("question_ids must be a LongTensor of shape [1, tokens]")
        protected = question_protection(input_ids.shape[-1], question_ids.shape[-1], resolved.sliding_window)
        protected = protected.to(input_ids.device)
        protect_positions = protected if protect_positions is None else torch.cat([protect_positions, protected])
        input_ids = torch.cat([input_ids, question_ids.to(input_ids.device)], dim=-1)
    prefill = observe_prefill(
        model, input_ids, window=resolved.observation_window, accumulate=resolved.needs_accumulated
    )
    keep = resolved.keep_indices(prefill.observations, rate, protect_positions)
    prefill.cache.evict(keep)
    return prefill.cache


@dataclass(frozen=True)
class EvictionConfig:
    """The one-call configuration: evict `eviction_rate` of each prompt's evictable entries.

    `eviction_mode` is a policy spec (scorer, optionally `+allocator` and parameters); `budget`
    names the allocator when the spec does not.
    """

    eviction_rate: float
    eviction_mode: str = "importance"
    budget: str | None = None
    n_sink: int = 1
    sliding_window: int = 32

    def __post_init__(self) -> None:
        check_rate(self.eviction_rate)
        self.policy()  # validates the mode and the protection

    def policy(self) -> Policy:
        return make_policy(
            self.eviction_mode, budget=self.budget, n_sink=self.n_sink, sliding_window=self.sliding_window
        )


class SieveHandle:
    """Returned by `apply`: while active, `model.generate()` compresses each prompt first.

    The prompt minus its last token is prefilled and compressed; `generate` then feeds the
    last token and decodes from the compressed cache. Prompts with nothing evictable are
    not compressed. `last_cache` is the cache of the latest call. Use `remove()` or a
    with-block to restore the model's own `generate`.
    """

    def __init__(self, model: torch.nn.Module, config: EvictionConfig) -> None:
        self.model = model
        self.config = config
        self.last_cache: SievedCache | None = None
        self._policy = config.policy()
        self._original = model.generate

        @functools.wraps(self._original)
        def generate(*args: object, **kwargs: object) -> torch.Tensor:
            return self._generate(*args, **kwargs)

        model.generate = generate

    def _generate(self, inputs: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor:
        input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
        if kwargs.get("past_key_values") is not None or not isinstance(input_ids, torch.Tensor):
            return self._original(input_ids, **kwargs)
        context = input_ids[:, :-1]
        if context.shape[-1] > self._policy.n_sink + self._policy.sliding_window:
            cache = compress(self.model, context, self._policy, self.config.eviction_rate)
            kwargs["past_key_values"] = self.last_cache = cache
        return self._original(input_ids, **kwargs)

    def remove(self) -> None:
        """Restore the model's own `generate`."""
        if self.model.__dict__.get("generate") is not None:
            del self.model.generate

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
        raise RuntimeError("a kvsieve policy is already applied to this model; remove() it first")
    return SieveHandle(model, config)
