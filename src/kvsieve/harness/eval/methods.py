"""What the harness evaluates: ways to build a cache for a case, behind one small protocol.

A *case* is one sequence to compress: a sample in one mode (task sweeps, the diagnostic) or a
document's prefix (perplexity). A *method* is a way to build a cache for a case at a rate: the
full cache, a kvsieve policy, a kvpress press, or a kvsieve policy with forced slots. Every
evaluation is a loop over cases and methods; how a method prepares, compresses and decodes is
its own business:

- a method declares its `builder`; configurations of one builder are built together, as the
  rows of one cache (`FROM_PREFILL`: every eviction of the case's one observed prefill, "prefill
  once, sieve many") or one at a time (`PRESS`: kvpress compresses during its own prefill);
- a `Compressed` carries its own decoding: the attention to run, and how many tokens one
  forward may feed (kvpress's AdaKV), so `answer` and `continuation_nll` need nothing else;
- a method opens its own `Stream` for streaming perplexity (`stream`): a document fed chunk by
  chunk through a cache held at a size.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from transformers import Cache

from ...runtime.api.compress import bounded_cache_with
from ...runtime.api.evictions import Eviction, evictions
from ...runtime.attention.sieve import sieve_attention
from ...runtime.observing.prefill import Prefill, observe_prefill
from ...runtime.storage.cache import SievedCache
from ...runtime.storage.codecs import storage_codec
from ...selection.budget import MaxTokens
from ...selection.observation import Needs
from ...selection.policy import Policy
from ...selection.protection import DEFAULT_N_RECENT, DEFAULT_N_SINK, question_protection
from ...selection.spans import sentence_spans
from ...selection.storage import FULL_STORAGE, Storage
from ..data.sample import EncodedSample
from .margins import Margin, margins
from .respond import Response, continuation_nll, respond
from .routing import survival_from_cache
from .streams import SievedStream, Stream


@dataclass
class Case:
    """One sequence to build caches for.

    Attributes:
        ids: `[1, n]` the tokens prefilled and compressed (a context, or a context and a question).
        n_context: how many of them are context (the rest, a question, is never evicted).
        index: the case's number (seeded scorers draw fresh randomness for each case).
        needs: what the shared observed prefill records (the union of the methods' needs).
        evidence_spans: `[start, end)` context token ranges the answer depends on (for forced slots).
        tokenizer: the model's, for a method that asks the model to repeat the case (``kvzip``) and for the
            sentences ``projection=sentence`` keeps (`spans`).
    """

    ids: torch.Tensor
    n_context: int
    index: int = 0
    needs: Needs = field(default_factory=Needs)
    evidence_spans: tuple[tuple[int, int], ...] = ()
    tokenizer: Any = None
    _prefill: Prefill | None = field(default=None, init=False, repr=False)
    prefill_seconds: float = field(default=0.0, init=False)

    @property
    def n_question(self) -> int:
        return int(self.ids.shape[1]) - self.n_context

    @functools.cached_property
    def spans(self) -> torch.Tensor | None:
        """A sentence number per token of `ids` (`kvsieve.sentence_spans`); None without a tokenizer."""
        return None if self.tokenizer is None else sentence_spans(self.tokenizer, self.ids[0])

    def prefill(self, model: torch.nn.Module) -> Prefill:
        """The case's observed full prefill, run once (timed in `prefill_seconds`)."""
        if self._prefill is None:
            tick = time.perf_counter()
            self._prefill = observe_prefill(model, self.ids, self.needs, tokenizer=self.tokenizer)
            self.prefill_seconds = time.perf_counter() - tick
        return self._prefill

    def fresh(self) -> Case:
        """The same case with no prefill yet (to prefill again, as a library without prefill sharing must)."""
        return dataclasses.replace(self)


@dataclass
class Compressed:
    """Caches of several configurations of one case, ready to decode from: row `i` is configuration `i`.

    Attributes:
        cache: the cache to continue from.
        kv_bytes: per row, bytes of keys and values the cache really holds.
        survival: per row, `[layers, kv_heads, n_context]` bool: the context entries decoding can still attend to.
        decoding: makes what must be active while decoding from it (sieve attention, or kvpress's masking).
        max_feed: the most tokens one forward may feed (see `PressedCache.max_feed`).
    """

    cache: Cache
    kv_bytes: list[int]
    survival: list[torch.Tensor]
    decoding: Callable[[], AbstractContextManager]
    max_feed: int | None = None

    def answer(
        self, model: torch.nn.Module, prompt: torch.Tensor, gold: torch.Tensor, max_new_tokens: int, rank_index: int
    ) -> list[Response]:
        """`respond` for every row: the gold answer teacher-forced, then a greedy answer (the cache grows)."""
        with self.decoding():
            return respond(
                model, self.cache, prompt, gold, max_new_tokens, rank_index=rank_index, max_feed=self.max_feed
            )

    def margins(
        self, model: torch.nn.Module, prompt: torch.Tensor, encoded: EncodedSample, tokenizer: Any
    ) -> list[Margin]:
        """Per row: the gold answer's margin over its best competitor (the cache is left as it is)."""
        with self.decoding():
            return margins(model, self.cache, prompt, encoded, self.max_feed, tokenizer)

    def continuation_nll(self, model: torch.nn.Module, ids: torch.Tensor) -> list[float]:
        """Per row: the summed NLL of `ids[:, 1:]` when `ids[:, :-1]` is fed after the cache, teacher-forced."""
        with self.decoding():
            return continuation_nll(model, self.cache, ids, self.max_feed)


Configuration = tuple["CacheMethod", float]


class CacheBuilder(Protocol):
    """Builds the caches of several configurations of one case, as the rows of one `Compressed`."""

    #: configurations one build takes (None: any number).
    max_rows: int | None
    #: whether it evicts from the case's shared prefill (its time is then shared by the configurations).
    shares_prefill: bool

    def build(self, model: torch.nn.Module, case: Case, todo: Sequence[Configuration]) -> Compressed: ...


class CacheMethod(Protocol):
    """A way to build a cache for a case: the full cache, a kvsieve policy, a kvpress press, forced slots."""

    name: str
    library: str
    builder: CacheBuilder

    @property
    def needs(self) -> Needs:
        """What the case's shared prefill must record for this method."""
        ...

    @property
    def is_full(self) -> bool: ...

    @property
    def protected(self) -> int:
        """Entries per (layer, kv-head) it never evicts at the start and end of a sequence (sinks, recent tail)."""
        ...

    def stream(self, model: torch.nn.Module, budget: int | None, buffer: int, seed: int) -> Stream:
        """A cache to feed documents through, held at `budget` entries per (layer, kv-head) (the full cache: none).

        `buffer` is the chunk every forward feeds; `seed` draws fresh randomness per batch of documents.
        """
        ...


class Evicting(CacheMethod, Protocol):
    """A method that evicts from the case's shared prefill (`FROM_PREFILL`)."""

    def eviction(self, case: Case, rate: float) -> Eviction: ...


@dataclass(frozen=True)
class FromPrefill:
    """Every configuration evicts from the case's one observed prefill; one row each ("prefill once, sieve many").

    The kept entries are stored as `storage` says (`kvsieve.compress`'s `kv_bits`, ...): configurations
    of other storage are other builds from the same prefill.
    """

    max_rows: int | None = None
    shares_prefill: bool = True
    storage: Storage = FULL_STORAGE

    def build(self, model: torch.nn.Module, case: Case, todo: Sequence[tuple[Evicting, float]]) -> Compressed:
        prefill = case.prefill(model)
        plans = [method.eviction(case, rate) for method, rate in todo]
        cache = evictions(prefill, plans, codec=storage_codec(self.storage, model))
        rows = range(len(plans))
        return Compressed(
            cache,
            [cache.row_nbytes(row) for row in rows],
            [survival_from_cache(cache, case.n_context, row) for row in rows],
            functools.partial(sieve_attention, model),
        )


FROM_PREFILL = FromPrefill()

FULL = "full"
KVPRESS_PREFIX = "kvpress:"


def reseeded(policy: Policy, index: int) -> Policy:
    """Seeded scorers draw fresh randomness for every case (document, sample)."""
    if dataclasses.is_dataclass(policy.scorer) and any(f.name == "seed" for f in dataclasses.fields(policy.scorer)):
        scorer = dataclasses.replace(policy.scorer, seed=policy.scorer.seed * 10_007 + index)
        return dataclasses.replace(policy, scorer=scorer)
    return policy


@dataclass(frozen=True)
class FullCache:
    """The full cache: every entry of the prefill (the reference every other method is compared to)."""

    name: ClassVar[str] = FULL
    library: ClassVar[str] = "kvsieve"
    builder: ClassVar[CacheBuilder] = FROM_PREFILL
    is_full: ClassVar[bool] = True
    protected: ClassVar[int] = 0

    @property
    def needs(self) -> Needs:
        return Needs()

    def eviction(self, case: Case, rate: float) -> Eviction:
        return Eviction(None)

    def stream(self, model: torch.nn.Module, budget: int | None, buffer: int, seed: int) -> Stream:
        return SievedStream(model, SievedCache())


@dataclass(frozen=True)
class KvsievePolicy:
    """A kvsieve policy at a rate; question-aware cases protect the question as `kvsieve.compress` does.

    The policy's storage says how the kept entries are stored (``snapkv+adaptive:window=16,kv_bits=4``).
    """

    policy: Policy
    library: ClassVar[str] = "kvsieve"
    is_full: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def builder(self) -> CacheBuilder:
        return FromPrefill(storage=self.policy.storage)

    @property
    def needs(self) -> Needs:
        return self.policy.needs

    @property
    def protected(self) -> int:
        return self.policy.n_sink + self.policy.n_recent

    def protect(self, case: Case) -> torch.Tensor | None:
        """Positions no eviction of this case may touch (the question and the context's recent tail)."""
        if not case.n_question:
            return None
        return question_protection(case.n_context, case.n_question, self.policy.n_recent)

    def eviction(self, case: Case, rate: float) -> Eviction:
        spans = case.spans if self.policy.reads_spans else None
        return Eviction(reseeded(self.policy, case.index), rate, self.protect(case), spans)

    def stream(self, model: torch.nn.Module, budget: int | None, buffer: int, seed: int) -> Stream:
        if budget is None:
            raise ValueError(f"{self.name} streams at a budget (max_tokens)")
        policy = reseeded(self.policy, seed)
        return SievedStream(model, bounded_cache_with(model, policy, MaxTokens(budget), buffer))


@dataclass(frozen=True)
class PressCompression:
    """A kvpress press compresses during its own prefill of the case: one configuration per build."""

    max_rows: int | None = 1
    shares_prefill: bool = False

    def build(self, model: torch.nn.Module, case: Case, todo: Sequence[tuple[KvpressPress, float]]) -> Compressed:
        from ..compare.kvpress import kvpress_compress

        if len(todo) != 1:
            raise ValueError("kvpress configurations are compressed one at a time")
        (method, rate) = todo[0]
        n_protected = DEFAULT_N_SINK + DEFAULT_N_RECENT + case.n_question
        pressed = kvpress_compress(
            model,
            case.ids,
            method.press,
            rate,
            n_protected=n_protected,
            kv_bits=method.kv_bits,
            tokenizer=case.tokenizer,
        )
        visible = pressed.visible[..., : case.n_context]
        return Compressed(
            pressed.cache, [pressed.kv_bytes], [visible], functools.partial(pressed.decoding, model), pressed.max_feed
        )


PRESS = PressCompression()


@dataclass(frozen=True)
class KvpressPress:
    """An NVIDIA kvpress press (`kvsieve.harness.compare.kvpress`), named ``kvpress:<press>``; with `kv_bits` 4 or 2
    it compresses `transformers`' quantized cache (``kvpress:<press>:kv_bits=4``)."""

    press: str
    kv_bits: int = 16
    library: ClassVar[str] = "kvpress"
    builder: ClassVar[CacheBuilder] = PRESS
    is_full: ClassVar[bool] = False
    protected: ClassVar[int] = 0  # kvpress's scorer presses protect nothing (tova: its scoring token)

    @property
    def name(self) -> str:
        storage = "" if self.kv_bits == 16 else f":kv_bits={self.kv_bits}"
        return f"{KVPRESS_PREFIX}{self.press}{storage}"

    @property
    def needs(self) -> Needs:
        return Needs()

    def stream(self, model: torch.nn.Module, budget: int | None, buffer: int, seed: int) -> Stream:
        from ..compare.kvpress import PressStream

        if budget is None:
            raise ValueError(f"{self.name} streams at a budget (target_size)")
        if self.kv_bits != 16:
            raise ValueError(f"{self.name}: kvpress streams run on its full-precision cache here; drop kv_bits")
        return PressStream(model, self.press, budget, buffer, seed)


def passes(todo: Sequence[Configuration], rows_per_pass: int) -> list[list[Configuration]]:
    """Configurations of one builder in even passes of at most `rows_per_pass` (and the builder's `max_rows`).

    A batched cache is read padded to its widest row, so configurations go in order of rate and a
    pass holds caches of similar size.
    """
    passes: list[list[Configuration]] = []
    for builder in dict.fromkeys(m.builder for m, _ in todo):
        group = sorted((t for t in todo if t[0].builder == builder), key=lambda t: t[1])
        limit = min(rows_per_pass, builder.max_rows or rows_per_pass)
        size = math.ceil(len(group) / math.ceil(len(group) / limit))
        passes += [group[i : i + size] for i in range(0, len(group), size)]
    return passes


def build(model: torch.nn.Module, case: Case, todo: Sequence[Configuration]) -> Compressed:
    """The caches of configurations that share one builder, as rows of one `Compressed`."""
    builders = {method.builder for method, _ in todo}
    if len(builders) != 1:
        raise ValueError("configurations built together must share one builder")
    return todo[0][0].builder.build(model, case, todo)
