"""`apply` a policy to a model: while active, every `model.generate()` compresses its prompt first."""

from __future__ import annotations

import functools
from contextlib import ExitStack
from types import TracebackType

import torch

from .attention import sieve_attention
from .cache import SievedCache
from .config import EvictionConfig
from .decoding import generate_compressed


class SieveHandle:
    """Returned by `apply`: while active, `model.generate()` compresses each prompt first.

    The model runs on sieve attention while the handle is active. Each prompt minus its last
    token is prefilled and compressed (every row of a batch with its own budget; pass the
    `attention_mask` of a padded batch); `generate` then feeds the last token and decodes from
    the compressed cache, which a size budget keeps bounded however long the generation.
    Question-aware: `model.generate(context_ids, question_ids=question, ...)` compresses the
    context after the question is seen and keeps the question (and the context's recent tail)
    protected; the output starts with the context and the question. Prompts too short to evict
    follow `kvsieve.runtime.decoding`'s rule (under a rate they are not compressed, and
    `last_cache` is None). `last_cache` is the cache of the latest call. `remove()` (or leaving
    the with-block) gives the model back its own `generate` and attention.
    """

    def __init__(self, model: torch.nn.Module, config: EvictionConfig) -> None:
        self.model = model
        self.config = config
        self.last_cache: SievedCache | None = None
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
        if kwargs.get("past_key_values") is not None or not isinstance(input_ids, torch.Tensor):
            if kwargs.get("question_ids") is not None:
                raise ValueError("question_ids go with a prompt (input_ids) and no past_key_values")
            return original(input_ids, **kwargs)
        config = self.config
        out, self.last_cache = generate_compressed(
            self.model, original, input_ids, config.resolved, config.limit(), config.generation_buffer(), **kwargs
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
