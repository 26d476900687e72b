"""Policy = scorer + allocator + protection; the registry and the "name+allocator:key=value" parser."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .allocators import ALLOCATORS, keep_indices
from .observe import DEFAULT_WINDOW, Observation
from .scorers import SCORERS, Scorer

DEFAULT_N_SINK = 1
DEFAULT_SLIDING_WINDOW = 32


class PolicyError(ValueError):
    """An unknown policy, allocator or parameter, or a value outside its range."""


def check_rate(rate: float) -> float:
    """Eviction rates live in [0, 1): 1 would evict every evictable entry."""
    if not isinstance(rate, (int, float)) or not 0.0 <= float(rate) < 1.0:
        raise PolicyError(f"eviction rate must be in [0, 1), got {rate!r}")
    return float(rate)


def protected_mask(
    positions: torch.Tensor,
    seen_tokens: int,
    n_sink: int,
    sliding_window: int,
    protect_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[n]` bool: sinks (first `n_sink` positions), the last `sliding_window` positions, and caller-given ones."""
    mask = (positions < n_sink) | (positions >= seen_tokens - sliding_window)
    if protect_positions is not None:
        mask |= torch.isin(positions, protect_positions.to(positions.device))
    return mask


@dataclass(frozen=True)
class Policy:
    """Which entries to keep: a scorer, an allocator and the protection rule.

    `rate` counts the evicted fraction of the evictable (unprotected) entries.
    """

    scorer: Scorer
    allocator: str = "uniform"
    n_sink: int = DEFAULT_N_SINK
    sliding_window: int = DEFAULT_SLIDING_WINDOW

    def __post_init__(self) -> None:
        if self.allocator not in ALLOCATORS:
            raise PolicyError(f"unknown allocator {self.allocator!r}; known: {', '.join(sorted(ALLOCATORS))}")
        if self.n_sink < 0 or self.sliding_window < 0:
            raise PolicyError("n_sink and sliding_window must be >= 0")

    @property
    def name(self) -> str:
        return self.scorer.name if self.allocator == "uniform" else f"{self.scorer.name}+{self.allocator}"

    @property
    def observation_window(self) -> int:
        """The last-query window the prefill must record for this policy's scorer."""
        return getattr(self.scorer, "window", DEFAULT_WINDOW)

    def keep_indices(
        self,
        observations: Sequence[Observation],
        rate: float,
        protect_positions: torch.Tensor | None = None,
    ) -> list[list[torch.Tensor]]:
        """Indices of the stored entries to keep, per layer and kv-head."""
        rate = check_rate(rate)
        seen = int(observations[0].positions.max()) + 1
        protected = [
            protected_mask(o.positions, seen, self.n_sink, self.sliding_window, protect_positions) for o in observations
        ]
        n_evictable = int((~protected[0]).sum())
        if rate > 0 and n_evictable == 0:
            raise PolicyError(
                f"nothing to evict: the context has {seen} tokens and all are protected "
                f"(n_sink={self.n_sink}, sliding_window={self.sliding_window}); "
                "use a longer context or less protection"
            )
        scores = [self.scorer.score(o) for o in observations]
        for o, s in zip(observations, scores, strict=True):
            if s.shape != (o.num_kv_heads, o.length):
                raise ValueError(
                    f"{self.scorer.name} returned scores of shape {tuple(s.shape)} for layer {o.layer_idx}, "
                    f"expected {(o.num_kv_heads, o.length)}"
                )
        counts = ALLOCATORS[self.allocator](scores, protected, rate)
        return [keep_indices(s, p, c) for s, p, c in zip(scores, protected, counts, strict=True)]


_POLICY_FIELDS = ("n_sink", "sliding_window")


def _convert(value: str, like: object, key: str) -> object:
    try:
        if isinstance(like, bool):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return value.lower() in ("true", "1")
        return type(like)(value)
    except ValueError:
        raise PolicyError(f"parameter {key}={value!r} is not a valid {type(like).__name__}") from None


def make_policy(spec: str | Policy, **params: object) -> Policy:
    """Build a policy from "scorer[+allocator][:key=value,...]" (or return a given `Policy`).

    Keyword `params` override the spec's; keys are the scorer's fields plus
    `n_sink` and `sliding_window`.
    """
    if isinstance(spec, Policy):
        if params:
            raise PolicyError("parameters cannot be given together with a Policy object")
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise PolicyError(f"a policy is a name such as 'importance', got {spec!r}; known: {', '.join(SCORERS)}")
    head, _, param_text = spec.strip().partition(":")
    scorer_name, _, allocator = head.partition("+")
    if scorer_name not in SCORERS:
        raise PolicyError(f"unknown policy {scorer_name!r}; known: {', '.join(SCORERS)}")
    scorer_cls = SCORERS[scorer_name]
    defaults = {f.name: f.default for f in dataclasses.fields(scorer_cls)}
    defaults |= {"n_sink": DEFAULT_N_SINK, "sliding_window": DEFAULT_SLIDING_WINDOW}
    given: dict[str, object] = {}
    for item in filter(None, (p.strip() for p in param_text.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise PolicyError(f"policy parameter {item!r} is not key=value")
        if key.strip() not in defaults:
            raise PolicyError(
                f"unknown parameter {key.strip()!r} for {scorer_name}; valid: {', '.join(defaults) or 'none'}"
            )
        given[key.strip()] = _convert(value.strip(), defaults[key.strip()], key.strip())
    for key, value in params.items():
        if key not in defaults:
            raise PolicyError(f"unknown parameter {key!r} for {scorer_name}; valid: {', '.join(defaults)}")
        given[key] = value
    policy_kwargs = {k: given.pop(k) for k in _POLICY_FIELDS if k in given}
    return Policy(scorer=scorer_cls(**given), allocator=allocator or "uniform", **policy_kwargs)


def known_policies() -> list[str]:
    return list(SCORERS)
