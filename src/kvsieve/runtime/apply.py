"""`apply` a policy to a model: while active, every `model.generate()` compresses its prompt first."""

from __future__ import annotations

import functools
from contextlib import ExitStack
from dataclasses import dataclass
from types import TracebackType

import torch

from ..selection.budget import check_count, make_budget
from ..selection.errors import PolicyError
from ..selection.policy import DEFAULT_N_SINK, DEFAULT_SLIDING_WINDOW, Policy, make_policy
from .attention import sieve_attention
from .cache import SievedCache
from .decoding import compress_prompt, prompt_with_question, refuse_beams
from .growth import DEFAULT_BUFFER


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
