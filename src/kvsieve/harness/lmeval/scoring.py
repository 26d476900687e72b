"""Log-likelihoods under eviction: continuations after a compressed context, whole documents in a bounded cache.

`continuation_logprobs` is lm-eval's `loglikelihood` for one context and its continuations (the
choices of a multiple-choice question): the context but its last token is compressed once
(`kvsieve.runtime.api.decoding.compressed_prompt`, the path `generate` takes), the cache is copied into
one row per continuation, and the last context token followed by each continuation is fed through
it in one teacher-forced forward, so every continuation token is predicted from the evicted cache.
Nothing is evicted during that forward. `rolling_logprob` is `loglikelihood_rolling`: the streaming
perplexity protocol's feed (`kvsieve.harness.eval.streams`) through `kvsieve.bounded_cache`, or, for a
policy that scores by the model repeating its context (``kvzip``), through a cache evicted between
chunks as `kvsieve.compress(..., chunk=)` evicts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from ...runtime.api.compress import bounded_cache_with, evict_between_forwards, refuse_unevictable
from ...runtime.api.config import EvictionConfig
from ...runtime.api.decoding import compressed_prompt
from ...runtime.attention.sieve import sieve_attention
from ...runtime.compat import cache_argument
from ...runtime.eviction.growth import BoundedGrowth
from ...runtime.storage.cache import SievedCache
from ...selection.errors import PolicyError
from ..eval.streams import SievedStream, run_stream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Continuation:
    """lm-eval's answer to one loglikelihood request."""

    logprob: float
    greedy: bool  # every token is the argmax of its prediction


def _fed_rows(last: torch.Tensor, continuations: Sequence[torch.Tensor], pad: int) -> torch.Tensor:
    """`[n, width]`: the last context token, then each continuation but its last token, right-padded with `pad`."""
    width = max(len(c) for c in continuations)
    fed = torch.full((len(continuations), width), pad, dtype=torch.long, device=last.device)
    fed[:, 0] = last
    for row, tokens in enumerate(continuations):
        fed[row, 1 : len(tokens)] = tokens[:-1]
    return fed


def _full_prefill(model: torch.nn.Module, ids: torch.Tensor) -> SievedCache:
    """A cache holding every entry of `ids` (`[1, n]`, n may be 0)."""
    cache = SievedCache.for_model(model)
    if ids.shape[1]:
        with sieve_attention(model):
            model(input_ids=ids, **cache_argument(model, cache), use_cache=True)
    return cache


@torch.no_grad()
def continuation_logprobs(
    model: torch.nn.Module,
    config: EvictionConfig | None,
    context: torch.Tensor,
    continuations: Sequence[torch.Tensor],
    question_start: int | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> list[Continuation]:
    """Score every continuation (1-D ids) after `context` (`[1, n]`, n >= 1) compressed as `config` says
    (None: the full cache).

    `question_start`: where the question begins in `context` (question-aware compression: the context
    before it is compressed after the question is seen, and the question stays protected); None:
    question-agnostic. Under a rate, a context too short to evict is not compressed (the rule of
    `kvsieve.runtime.api.decoding`); the continuations then see the whole context. `tokenizer`: the
    model's, for a policy that asks the model to repeat its context (``kvzip``).
    """
    if not continuations or any(len(c) == 0 for c in continuations):
        raise ValueError("every loglikelihood request needs a non-empty continuation")
    device = context.device
    question = None
    if question_start is not None:
        context, question = context[:, :question_start], context[:, question_start:]
    prompt = context if question is None else torch.cat([context, question], dim=-1)
    cache = None
    if config is not None:
        codec = config.codec(model)
        cache = compressed_prompt(
            model, context, None, question, config.resolved, config.limit(), None, codec, tokenizer
        )
    if cache is None:  # the full cache, or a context too short to evict
        cache = _full_prefill(model, prompt[:, :-1])
    rows = cache if len(continuations) == 1 else cache.copy(rows=[0] * len(continuations))
    fed = _fed_rows(prompt[0, -1], [c.to(device) for c in continuations], pad=0)
    with sieve_attention(model):
        logits = model(input_ids=fed, **cache_argument(model, rows), use_cache=True).logits
    logprobs = F.log_softmax(logits.float(), dim=-1)
    scored = []
    for row, tokens in enumerate(continuations):
        predicted = logprobs[row, : len(tokens)]
        tokens = tokens.to(device)
        total = predicted.gather(-1, tokens[:, None]).sum()
        scored.append(Continuation(float(total), bool((predicted.argmax(-1) == tokens).all())))
    return scored


class ReconstructingStream(SievedStream):
    """A cache held at a size for a policy that scores by the model repeating its context (``kvzip``).

    Before a chunk would take a sequence past the size plus `buffer` entries per (layer, kv-head), the
    model repeats every token fed so far after what the cache holds, and that attention decides what
    stays: the evictions of `kvsieve.compress(..., chunk=buffer)`, between forwards (a forward cannot
    run inside another, so the cache's own append hook cannot do it).
    """

    def __init__(
        self, model: torch.nn.Module, config: EvictionConfig, ids: torch.Tensor, tokenizer: PreTrainedTokenizerBase
    ) -> None:
        refuse_unevictable(model, config.limit())
        super().__init__(model, SievedCache.for_model(model, config.codec(model)))
        self.growth = BoundedGrowth.of(config.resolved, config.limit(), config.buffer, model)
        self.ids, self.tokenizer = ids, tokenizer

    def forward(self, chunk_ids: torch.Tensor, start: int) -> torch.Tensor:
        if self.growth.overflows(self.cache, chunk_ids.shape[1]):
            evict_between_forwards(self.model, self.cache, self.growth, self.ids[:, :start], self.tokenizer)
        return super().forward(chunk_ids, start)


def rolling_logprob(
    model: torch.nn.Module,
    config: EvictionConfig | None,
    ids: torch.Tensor,
    chunk: int,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> float:
    """The log-probability of `ids[0, 1:]` (`[1, n]`, a prefix token first) fed `chunk` tokens per forward
    through a cache bounded at `config`'s size plus its buffer (`kvsieve.bounded_cache`; None: the full cache).

    `tokenizer`: the model's, for a policy that asks the model to repeat its context (``kvzip``:
    `ReconstructingStream`).
    """
    if config is None:
        stream = SievedStream(model, SievedCache.for_model(model))
    elif not (config.sized and config.buffer is not None):
        raise ValueError("rolling log-likelihood needs a bounded cache: give max_tokens or max_bytes, and a buffer")
    elif config.resolved.needs.reconstruction is None:
        cache = bounded_cache_with(model, config.resolved, config.limit(), config.buffer, config.codec(model))
        stream = SievedStream(model, cache)
    elif tokenizer is None:
        raise PolicyError(f"policy {config.resolved.name!r} asks the model to repeat its context: give the tokenizer")
    else:
        stream = ReconstructingStream(model, config, ids, tokenizer)
    trace = run_stream(ids, stream, chunk)
    return -float(np.nansum(trace.nll))
