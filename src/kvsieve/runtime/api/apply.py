"""`apply` a policy to a model: while active, every `model.generate()` compresses its prompt first."""

from __future__ import annotations

import functools
import warnings
from contextlib import ExitStack
from types import TracebackType
from typing import Any

import torch

from ..attention.sieve import sieve_attention
from ..compat import passed_cache
from ..storage.cache import SievedCache
from .config import EvictionConfig
from .decoding import generate_compressed


class UncompressedForwardWarning(UserWarning):
    """A plain forward ran inside `apply` on the full cache (`apply` compresses `generate()` prompts only)."""


UNCOMPRESSED_FORWARD = (
    "model(...) ran inside kvsieve.apply on the full cache: apply compresses the prompts of model.generate() "
    "only. To score text under eviction, compress the context with kvsieve.compress and feed the rest through "
    "the returned cache, or evaluate with lm-eval's model type 'kvsieve' (`kvsieve lm-eval --model kvsieve ...`)"
)


class SieveHandle:
    """Returned by `apply`: while active, `model.generate()` compresses each prompt first.

    The model runs on sieve attention while the handle is active. Each prompt minus its last
    token is prefilled and compressed (every row of a batch with its own budget; pass the
    `attention_mask` of a padded batch); `generate` then feeds the last token and decodes from
    the compressed cache, which a size budget keeps bounded however long the generation.
    Question-aware: `model.generate(context_ids, question_ids=question, ...)` compresses the
    context after the question is seen and keeps the question (and the context's recent tail)
    protected; the output starts with the context and the question. Prompts too short to evict
    follow `kvsieve.runtime.api.decoding`'s rule (under a rate they are not compressed, and
    `last_cache` is None). `last_cache` is the cache of the latest call. `remove()` (or leaving
    the with-block) gives the model back its own `generate` and attention.

    A forward the user calls directly (`model(ids)`, a log-likelihood) is not compressed: nothing
    says which of its tokens are the prompt. The first one without a `SievedCache` warns
    (`UncompressedForwardWarning`), once per handle.
    """

    def __init__(self, model: torch.nn.Module, config: EvictionConfig) -> None:
        self.model = model
        self.config = config
        self.last_cache: SievedCache | None = None
        self.codec = config.codec(model)
        self._generating = False
        self._warned = False
        self._scope = ExitStack()
        self._scope.enter_context(sieve_attention(model))
        original = model.generate

        @functools.wraps(original)
        def generate(*args: object, **kwargs: object) -> torch.Tensor:
            return self._generate(original, *args, **kwargs)

        model.generate = generate
        self._scope.callback(model.__dict__.pop, "generate", None)
        hook = model.register_forward_pre_hook(self._check_forward, with_kwargs=True)
        self._scope.callback(hook.remove)

    def _check_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """Warn once about a forward outside `generate` that runs on an uncompressed cache."""
        if self._generating or self._warned or isinstance(passed_cache(kwargs), SievedCache):
            return
        self._warned = True
        warnings.warn(UNCOMPRESSED_FORWARD, UncompressedForwardWarning, stacklevel=3)

    def _generate(self, original: object, inputs: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor:
        self._generating = True
        try:
            return self._compressed_generate(original, inputs, **kwargs)
        finally:
            self._generating = False

    def _compressed_generate(self, original: object, inputs: torch.Tensor | None, **kwargs: object) -> torch.Tensor:
        input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
        if passed_cache(kwargs) is not None or not isinstance(input_ids, torch.Tensor):
            if kwargs.get("question_ids") is not None:
                raise ValueError("question_ids go with a prompt (input_ids) and no cache")
            return original(input_ids, **kwargs)
        config = self.config
        out, self.last_cache = generate_compressed(
            self.model,
            original,
            input_ids,
            config.resolved,
            config.limit(),
            config.generation_buffer(),
            codec=self.codec,
            **kwargs,
        )
        return out

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
