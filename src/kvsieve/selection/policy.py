"""Policy = scorer + allocator + projection + protection: which entries of one sequence to keep (and how they are
stored)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .allocators import Allocator, Uniform
from .budget import Budget, Rate, as_budget
from .errors import PolicyError
from .fields import changed_fields
from .merge import MERGE_ONCE, NO_MERGE, Merge, Merged, folds, merge_evicted
from .observation import Needs, Observation
from .projection import Projection, TopK, check_spans
from .protection import DEFAULT_N_RECENT, DEFAULT_N_SINK, PROTECTION_DEFAULTS, protected_mask
from .scorers import Scorer
from .storage import FULL_STORAGE, Storage


def _format(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def non_defaults(obj: object) -> list[str]:
    """`key=value` for every init field of a dataclass whose value differs from its default."""
    return [f"{name}={_format(value)}" for name, value in changed_fields(obj).items()]


def projection_parameters(projection: Projection) -> list[str]:
    """A projection as a policy spec names it: `projection=NAME` and its parameters that differ from the defaults."""
    return [f"projection={projection.name}", *non_defaults(projection)]


def merge_parameters(merge: Merge) -> list[str]:
    """A merge as a policy spec names it: `merge=NAME` and its parameters that differ from the defaults."""
    return [f"merge={merge.name}", *non_defaults(merge)]


@dataclass(frozen=True)
class Policy:
    """Which entries to keep: a scorer, an allocator, a projection and the protection rule.

    A budget (`kvsieve.selection.budget`: a rate of the evictable, unprotected entries, or a size)
    sets how many entries stay; every allocator keeps the same total, so policies under one budget
    hold the same bytes. The projection (`kvsieve.selection.projection`) picks each (layer,
    kv-head)'s entries from its scores and its count: `TopK` (entry by entry), `Chunks` (whole
    chunks of token positions, ChunkKV, arXiv 2502.00299) or `Sentences` (whole caller-given spans).
    None (a spec that names none): the one the checkpoint of the gates the scorer reads records
    (`Needs.gates`, `RetentionGates.projection`), else `TopK`.
    The first `n_sink` entries and the last `n_recent` of every head are never evicted. `storage`
    (`kvsieve.selection.storage`) says how the kept entries are stored (``kv_bits=4``); `select` does not
    read it (its caller passes the bytes an entry is stored in), the runtime stores them so. `merge`
    (`kvsieve.selection.merge`, ``merge=window``) folds what each head evicts into one merged entry (`merged`),
    which takes the head's kept slots its bytes fill; None (a spec that names none): the one the checkpoint of the
    gates the scorer reads records (`RetentionGates.merge`), else none; `NO_MERGE` (``merge=none``): none.
    """

    scorer: Scorer
    allocator: Allocator = field(default_factory=Uniform)
    projection: Projection | None = None
    n_sink: int = DEFAULT_N_SINK
    n_recent: int = DEFAULT_N_RECENT
    storage: Storage = FULL_STORAGE
    merge: Merge | None = None

    def __post_init__(self) -> None:
        if self.n_sink < 0 or self.n_recent < 0:
            raise PolicyError("n_sink and n_recent must be >= 0")

    @property
    def name(self) -> str:
        """The canonical spec: `scorer[+allocator][:parameters that differ from the defaults]`, storage keys last."""
        head = self.scorer.name if self.allocator.name == "uniform" else f"{self.scorer.name}+{self.allocator.name}"
        params = [*non_defaults(self.scorer), *non_defaults(self.allocator)]
        protection = {key: getattr(self, key) for key in PROTECTION_DEFAULTS}
        params += [f"{key}={value}" for key, value in protection.items() if value != PROTECTION_DEFAULTS[key]]
        if self.projection is not None:
            params += projection_parameters(self.projection)
        if self.merge is not None:
            params += merge_parameters(self.merge)
        params += [f"{key}={value}" for key, value in self.storage.parameters().items()]
        return f"{head}:{','.join(params)}" if params else head

    @property
    def needs(self) -> Needs:
        """What the observed prefill must record for this policy."""
        return self.scorer.needs if self.merge is None else self.scorer.needs | self.merge.needs

    @property
    def names_merge(self) -> bool:
        """Whether it names a merge that folds what a head evicts (not ``merge=none``)."""
        return folds(self.merge)

    def evicting_again(self) -> Policy:
        """This policy for a cache that evicts again as it grows: a merge it names is an error (`MERGE_ONCE`),
        and the one its gates' checkpoint may record is not used (``merge=none``)."""
        if self.names_merge:
            raise PolicyError(MERGE_ONCE.format(policy=self.name))
        return dataclasses.replace(self, merge=NO_MERGE) if self.merge is None and self.needs.gates else self

    @property
    def needs_spans(self) -> bool:
        """Whether the projection it names keeps caller-given spans (and refuses to run without them)."""
        return self.projection is not None and self.projection.needs_spans

    @property
    def reads_spans(self) -> bool:
        """Whether `select` may read spans: its projection keeps them, or it names none and its scorer reads
        gates, whose checkpoint may record one that does."""
        return self.needs_spans or (self.projection is None and bool(self.needs.gates))

    @torch.no_grad()
    def select(
        self,
        observations: Sequence[Observation],
        budget: float | Budget,
        protect_positions: torch.Tensor | None = None,
        spans: torch.Tensor | None = None,
        entry_bytes: int | None = None,
    ) -> list[list[torch.Tensor]]:
        """Indices of the observed entries of one sequence to keep, per observed (full-attention) layer and kv-head.

        `budget` is a `kvsieve.selection.budget` budget, or an eviction rate; a byte budget must
        already have set aside what sliding-window layers hold (`Budget.reserve`). `spans`
        (`[n_tokens]`, a span id per token position of the sequence, e.g. its sentence number) is
        what the `Sentences` projection keeps whole; positions past its end are spans of their own.
        Other projections ignore it; a projection the gates' checkpoint records for a policy that names
        none falls back to `TopK`, with a warning, when `spans` is None. Each head keeps exactly the
        allocator's count of evictable entries; when the budget keeps every one of them (a prompt that
        fits a size), nothing is scored.
        `entry_bytes`: the bytes one entry will be stored in, which a byte budget counts (a quantized
        cache: codes and scales); default: the observed keys' and values' dtype.
        """
        budget = as_budget(budget)
        check_spans(spans)
        if not observations:
            if budget == Rate(0.0):
                return []
            raise PolicyError(
                "nothing to evict: the model has no full-attention layer, and sliding-window layers keep their own "
                "window (no policy evicts them); use rate=0"
            )
        protected = [protected_mask(o, self.n_sink, self.n_recent, protect_positions) for o in observations]
        evictable = [o.valid_mask & ~p for o, p in zip(observations, protected, strict=True)]
        stored = observations[0].entry_bytes if entry_bytes is None else entry_bytes
        shares = budget.shares(evictable, protected, stored)
        if _keeps_everything(evictable, shares):
            return [[o.valid_mask[h].nonzero().flatten() for h in range(o.num_kv_heads)] for o in observations]
        merge = self._merge(observations[0])
        if merge is not None:  # merged entries, in the model's dtype, fill slots
            slots = merge.parts * -(-observations[0].entry_bytes // stored)
            shares = [[max(0, share - slots) for share in per_head] for per_head in shares]
        projection = self._projection(observations[0], spans)
        scores = [self._scores(o) for o in observations]
        counts = self.allocator.counts(scores, evictable, shares, calibrated=self.scorer.calibrated)
        return [
            projection.pick(s, p, e, c, o.positions, spans)
            for o, s, p, e, c in zip(observations, scores, protected, evictable, counts, strict=True)
        ]

    def merged(
        self, observations: Sequence[Observation], kept: Sequence[Sequence[torch.Tensor]]
    ) -> list[Merged] | None:
        """Per observed layer, what each head evicted (every valid entry `kept`, `select`'s answer, does not name)
        folded into one merged entry; None for a policy that merges nothing (`_merge`)."""
        merge = self._merge(observations[0]) if observations else None
        if merge is None:
            return None
        return [merge_evicted(merge, o, k) for o, k in zip(observations, kept, strict=True)]

    def _merge(self, obs: Observation) -> Merge | None:
        """The merge it names (None for ``merge=none``); else the one its gates' checkpoint records; else None."""
        if self.merge is not None:
            return self.merge if self.names_merge else None
        recorded = (obs.facts.gates.get(source) for source in self.needs.gates)
        return next((gates.merge for gates in recorded if gates is not None and folds(gates.merge)), None)

    def _projection(self, obs: Observation, spans: torch.Tensor | None) -> Projection:
        """The projection it names; else the one its gates' checkpoint records (`Needs.gates`); else `TopK`."""
        if self.projection is not None:
            return self.projection
        for source in self.needs.gates:
            gates = obs.facts.gates.get(source)
            recorded = None if gates is None else gates.projection
            if recorded is None:
                continue
            if recorded.needs_spans and spans is None:
                warnings.warn(_unused(source, recorded), UserWarning, stacklevel=4)  # past torch.no_grad
                break
            return recorded
        return TopK()

    def _scores(self, obs: Observation) -> torch.Tensor:
        """The scorer's scores of one layer, checked for shape."""
        scores = self.scorer.score(obs)
        if scores.shape != (obs.num_kv_heads, obs.length):
            raise ValueError(
                f"{self.scorer.name} returned scores of shape {tuple(scores.shape)} for layer {obs.layer_idx}, "
                f"expected {(obs.num_kv_heads, obs.length)}"
            )
        return scores


def _unused(source: str, recorded: Projection) -> str:
    """Why a projection the gates' checkpoint records is not used: it keeps spans, and none were given."""
    spec = ",".join(projection_parameters(recorded))
    return (
        f"the retention gates {source!r} record {spec} for a policy that names no projection, which keeps whole "
        "sentences, and no spans were given: this eviction keeps entries one by one (projection=topk). Pass "
        "tokenizer= (or spans=) to kvsieve.compress, kvsieve.generate or model.generate to use it, or name "
        "projection=topk in the policy to keep this without the warning"
    )


def _keeps_everything(evictable: Sequence[torch.Tensor], shares: Sequence[Sequence[int]]) -> bool:
    """Whether every head's share covers all of its evictable entries (`[kv_heads, n]` masks per layer)."""
    return all(
        share >= n
        for masks, per_head in zip(evictable, shares, strict=True)
        for share, n in zip(per_head, masks.sum(dim=-1).tolist(), strict=True)
    )
