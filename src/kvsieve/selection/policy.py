"""Policy = scorer + allocator + protection; the registry and the "scorer+allocator:key=value" parser."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .allocators import ALLOCATORS, Allocator, Uniform
from .budget import Budget, Rate, as_budget
from .errors import PolicyError
from .observation import Needs, Observation
from .projection import DEFAULT_CHUNK_SIZE, DEFAULT_PROJECTION, Projection, check_spans, make_projection
from .protection import DEFAULT_N_SINK, DEFAULT_SLIDING_WINDOW, protected_mask
from .scorers import SCORERS, Scorer


def _format(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _non_defaults(obj: object) -> list[str]:
    if not dataclasses.is_dataclass(obj):
        return []
    return [
        f"{f.name}={_format(getattr(obj, f.name))}"
        for f in dataclasses.fields(obj)
        if f.init and getattr(obj, f.name) != f.default
    ]


@dataclass(frozen=True)
class Policy:
    """Which entries to keep: a scorer, an allocator, the protection rule and a projection.

    A budget (`kvsieve.budget`: a rate of the evictable, unprotected entries, or a size) sets how
    many entries stay; every allocator keeps the same total, so policies under one budget hold the
    same bytes. The projection (`kvsieve.projection`) picks each (layer, kv-head)'s entries from its
    scores and its count: ``topk`` (entry by entry), ``chunk`` (whole chunks of `chunk_size` token
    positions, ChunkKV, arXiv 2502.00299) or ``sentence`` (whole caller-given spans).
    """

    scorer: Scorer
    allocator: Allocator = field(default_factory=Uniform)
    n_sink: int = DEFAULT_N_SINK
    sliding_window: int = DEFAULT_SLIDING_WINDOW
    projection: str = DEFAULT_PROJECTION
    chunk_size: int = DEFAULT_CHUNK_SIZE

    def __post_init__(self) -> None:
        if self.n_sink < 0 or self.sliding_window < 0:
            raise PolicyError("n_sink and sliding_window must be >= 0")
        make_projection(self.projection, self.chunk_size)  # validates both

    @property
    def projector(self) -> Projection:
        """The projection named by `projection` (with `chunk_size` for ``chunk``)."""
        return make_projection(self.projection, self.chunk_size)

    @property
    def name(self) -> str:
        """The canonical spec: `scorer[+allocator][:parameters that differ from the defaults]`."""
        head = self.scorer.name if self.allocator.name == "uniform" else f"{self.scorer.name}+{self.allocator.name}"
        params = [*_non_defaults(self.scorer), *_non_defaults(self.allocator)]
        params += [f"{k}={getattr(self, k)}" for k, default in _POLICY_DEFAULTS.items() if getattr(self, k) != default]
        return f"{head}:{','.join(params)}" if params else head

    @property
    def needs(self) -> Needs:
        """What the observed prefill must record for this policy."""
        return self.scorer.needs

    @torch.no_grad()
    def keep_indices(
        self,
        observations: Sequence[Observation],
        budget: float | Budget,
        protect_positions: torch.Tensor | None = None,
        spans: torch.Tensor | None = None,
    ) -> list[list[torch.Tensor]]:
        """Indices of the observed entries of one sequence to keep, per observed (full-attention) layer and kv-head.

        `budget` is a `kvsieve.budget` budget, or an eviction rate; a byte budget must already have
        set aside what sliding-window layers hold (`Budget.reserve`). `spans` (`[n_tokens]`, a span id
        per token position of the sequence, e.g. its sentence number) is what ``projection=sentence``
        keeps whole; positions past its end are spans of their own. Other projections ignore it.
        Each head keeps exactly the allocator's count of evictable entries (`kvsieve.projection`).
        """
        budget = as_budget(budget)
        projector = self.projector
        check_spans(spans)
        if not observations:
            if budget == Rate(0.0):
                return []
            raise PolicyError(
                "nothing to evict: the model has no full-attention layer, and sliding-window layers keep their own "
                "window (no policy evicts them); use rate=0"
            )
        protected = [protected_mask(o, self.n_sink, self.sliding_window, protect_positions) for o in observations]
        evictable = [o.valid_mask & ~p for o, p in zip(observations, protected, strict=True)]
        shares = budget.shares(evictable, protected, observations[0].entry_bytes)
        scores = [self.scorer.score(o) for o in observations]
        for o, s in zip(observations, scores, strict=True):
            if s.shape != (o.num_kv_heads, o.length):
                raise ValueError(
                    f"{self.scorer.name} returned scores of shape {tuple(s.shape)} for layer {o.layer_idx}, "
                    f"expected {(o.num_kv_heads, o.length)}"
                )
        counts = self.allocator.counts(scores, evictable, shares, calibrated=self.scorer.calibrated)
        return [
            projector.select(s, p, e, c, o.positions, spans)
            for o, s, p, e, c in zip(observations, scores, protected, evictable, counts, strict=True)
        ]


_POLICY_DEFAULTS = {
    "n_sink": DEFAULT_N_SINK,
    "sliding_window": DEFAULT_SLIDING_WINDOW,
    "projection": DEFAULT_PROJECTION,
    "chunk_size": DEFAULT_CHUNK_SIZE,
}


def _convert(value: str, like: object, key: str) -> object:
    try:
        if isinstance(like, bool):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return value.lower() in ("true", "1")
        return type(like)(value)
    except ValueError:
        raise PolicyError(f"parameter {key}={value!r} is not a valid {type(like).__name__}") from None


def _defaults(cls: type) -> dict[str, object]:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.init}


def make_policy(spec: str | Policy, budget: str | None = None, **params: object) -> Policy:
    """Build a policy from "scorer[+allocator][:key=value,...]" (or return a given `Policy`).

    Args:
        spec: e.g. ``"snapkv"``, ``"snapkv+adaptive:window=32"``, ``"importance+global:calibration=zscore"``.
        budget: the allocator (``uniform``, ``pyramid``, ``adaptive``, ``global``), if not in `spec`.
        params: override the spec's; keys are the scorer's and the allocator's fields plus
            `n_sink`, `sliding_window`, `projection` (``topk``, ``chunk``, ``sentence``) and
            `chunk_size` (for ``chunk``), e.g. ``"snapkv+global:projection=chunk,chunk_size=16"``.
    """
    if isinstance(spec, Policy):
        if params or budget is not None:
            raise PolicyError("parameters or a budget cannot be given together with a Policy object")
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise PolicyError(f"a policy is a name such as 'snapkv', got {spec!r}; known: {', '.join(SCORERS)}")
    head, _, param_text = spec.strip().partition(":")
    scorer_name, _, allocator_name = (part.strip() for part in head.partition("+"))
    if scorer_name not in SCORERS:
        raise PolicyError(f"unknown policy {scorer_name!r}; known: {', '.join(SCORERS)}")
    if budget is not None and allocator_name and budget != allocator_name:
        raise PolicyError(f"policy {spec!r} names allocator {allocator_name!r} but budget={budget!r}")
    allocator_name = allocator_name or budget or "uniform"
    if allocator_name not in ALLOCATORS:
        raise PolicyError(f"unknown budget allocator {allocator_name!r}; known: {', '.join(ALLOCATORS)}")
    parts = {
        "scorer": _defaults(SCORERS[scorer_name]),
        "allocator": _defaults(ALLOCATORS[allocator_name]),
        "policy": dict(_POLICY_DEFAULTS),
    }
    owner = {key: part for part, defaults in parts.items() for key in defaults}
    valid = ", ".join(owner)
    label = scorer_name if allocator_name == "uniform" else f"{scorer_name}+{allocator_name}"
    given: dict[str, object] = {}
    for item in filter(None, (p.strip() for p in param_text.split(","))):
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq:
            raise PolicyError(f"policy parameter {item!r} is not key=value")
        given[key] = value
    given |= params
    for key, value in given.items():
        if key not in owner:
            raise PolicyError(f"unknown parameter {key!r} for {label}; valid: {valid}")
        if key not in params:  # spec text: convert to the type of the default
            given[key] = _convert(value, parts[owner[key]][key], key)
    kwargs = {part: {k: v for k, v in given.items() if owner[k] == part} for part in parts}
    try:
        scorer = SCORERS[scorer_name](**kwargs["scorer"])
        allocator = ALLOCATORS[allocator_name](**kwargs["allocator"])
    except (TypeError, ValueError) as err:
        raise PolicyError(f"{spec}: {err}") from None
    return Policy(scorer=scorer, allocator=allocator, **kwargs["policy"])


def split_policies(text: str) -> list[str]:
    """Split a comma-separated list of policy specs; `key=value` items belong to the spec before them.

    ``"snapkv+adaptive:window=16,kernel=7,random"`` -> ``["snapkv+adaptive:window=16,kernel=7", "random"]``.
    """
    specs: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "=" in part and ":" not in part and specs:
            specs[-1] += f",{part}"
        else:
            specs.append(part)
    return specs


def known_policies() -> list[str]:
    return list(SCORERS)
