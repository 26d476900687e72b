"""`EvictionConfig`: a policy and a budget for every prompt a model generates from (`kvsieve.apply`)."""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass, field

import torch

from ...selection.budget import Budget, check_count, make_budget
from ...selection.deprecation import renamed_keywords
from ...selection.errors import PolicyError
from ...selection.policy import Policy
from ...selection.spec import make_policy
from ...selection.storage import STORAGE_KEYS, Storage
from ..eviction.growth import DEFAULT_BUFFER
from ..storage.codecs import EntryCodec, storage_codec

#: `EvictionConfig`'s keywords before kvsieve 0.2, still taken with a `DeprecationWarning`.
_OLD_NAMES = ("eviction_rate", "eviction_mode", "budget", "sliding_window")


@dataclass(frozen=True)
class EvictionConfig:
    """A policy and a budget, with the names `kvsieve.compress` takes.

    The budget is `rate` (default 0.5) of each prompt's evictable entries, or a size: `max_tokens`
    per (layer, kv-head) on average, or `max_bytes` per sequence. A size also holds during
    generation: the cache is evicted back to it whenever it has grown by `buffer` tokens per (layer,
    kv-head) (`buffer=None`: compress the prompt only). `policy` is a `Policy` or a spec (scorer,
    optionally ``+allocator`` and parameters); `allocator`, `n_sink` and `n_recent` override the
    spec's. The storage keys `kv_bits` (16, 8, 4, 2), `kv_group`, `kv_residual` and `kv_codec` say how the kept
    entries are stored (`kvsieve.compress`); the spec may say it instead (``"h2o:kv_bits=8"``; a contradiction is
    an error). The keywords of kvsieve 0.1 (`eviction_rate`, `eviction_mode`, `budget` for the
    allocator, `sliding_window` for `n_recent`) still work, with a `DeprecationWarning`.
    """

    policy: str | Policy = "importance"
    rate: float | None = None
    max_tokens: int | None = None
    max_bytes: int | None = None
    buffer: int | None = DEFAULT_BUFFER
    allocator: str | None = None
    n_sink: int | None = None
    n_recent: int | None = None
    kv_bits: int = 16
    kv_group: int | None = None
    kv_residual: int | None = None
    kv_codec: str | None = None
    eviction_rate: InitVar[float | None] = None
    eviction_mode: InitVar[str | None] = None
    budget: InitVar[str | None] = None
    sliding_window: InitVar[int | None] = None
    resolved: Policy = field(init=False, repr=False, compare=False)

    def __post_init__(self, *old: object) -> None:
        if isinstance(self.policy, (int, float)):
            raise PolicyError(
                f"EvictionConfig takes the policy first, got {self.policy!r}: give the eviction rate as rate= "
                "(the first argument was eviction_rate before kvsieve 0.2)"
            )
        given = {name: value for name, value in zip(_OLD_NAMES, old, strict=True) if value is not None}
        for name, value in renamed_keywords(given, "EvictionConfig", _OLD_NAMES).items():
            default = {f.name: f.default for f in dataclasses.fields(self)}[name]
            if getattr(self, name) != default:
                raise PolicyError(f"EvictionConfig: give {name}= only (it has a deprecated name too)")
            object.__setattr__(self, name, value)
        self.limit()  # validates the budget
        overrides = {k: v for k, v in (("n_sink", self.n_sink), ("n_recent", self.n_recent)) if v is not None}
        storage = {key: getattr(self, key) for key in STORAGE_KEYS}
        policy = make_policy(self.policy, self.allocator, **storage, **overrides)  # checks the storage too
        if self.sized and self.buffer is not None:
            check_count("buffer", self.buffer)
        object.__setattr__(self, "resolved", policy)

    @property
    def sized(self) -> bool:
        """Whether the budget is a size (and so bounds generation)."""
        return self.limit().is_size

    def limit(self) -> Budget:
        """The budget as a `Rate`, `MaxTokens` or `MaxBytes`."""
        return make_budget(self.rate, self.max_tokens, self.max_bytes)

    def storage(self) -> Storage:
        """How the kept entries are stored (the policy's storage, with `kv_bits`, ... given here)."""
        return self.resolved.storage

    def codec(self, model: torch.nn.Module) -> EntryCodec:
        """How the model's kept entries are stored (checked against its head dimension)."""
        return storage_codec(self.storage(), model)

    def generation_buffer(self) -> int | None:
        """The buffer that bounds generation: `buffer` for a size, None for a rate."""
        return self.buffer if self.sized else None
