"""Projections: how one head's scores and keep count become the entries it keeps.

The scorer scores every entry and the allocator sets how many evictable entries each (layer,
kv-head) keeps; the projection picks them. `topk` keeps the best-scored entries one by one.
`chunk` (ChunkKV, arXiv 2502.00299) and `sentence` keep whole spans of tokens: fixed-size chunks
of token positions (`position // chunk_size`), or spans the caller gives (a span id per token
position, e.g. `kvsieve.sentence_spans`).

Span selection, within one (layer, kv-head): only evictable entries are ranked (protected ones
are always kept, on top of the head's count). A span's score is the mean score of its evictable
entries. Spans are taken in order of score (ties: the span whose first entry comes first) while
they fit whole in what is left of the head's count; a span that does not fit is skipped. If
entries are left to fill when no unused span fits, the best-ranked unused span gives its
best-scored entries for exactly the rest, so at most one span per head is cut and the head keeps
exactly its count. Scores of +-inf rank as such (a span holding both ranks last); NaN is an error.

Both span projections take `best_tokens`: the fraction of each head's evictable entries (rounded,
at most its count) first kept entry by entry, the best-scored as `topk` keeps them, the rest of the
count then span by span among the entries left. With ``projection=sentence,best_tokens=0.1`` a head
that keeps 10% or less keeps as `topk` does, and one that keeps 25% keeps its best 10% one by one
and 15% in whole sentences.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from .allocators import top_scored
from .errors import PolicyError

DEFAULT_CHUNK_SIZE = 8
DEFAULT_BEST_TOKENS = 0.0

MISSING_SPANS = (
    "projection=sentence keeps whole caller-given spans, and none were given: pass spans (a span id per token "
    "position, e.g. kvsieve.sentence_spans(tokenizer, input_ids)) to kvsieve.compress, kvsieve.generate, "
    "Policy.select or Eviction, or pass tokenizer= to kvsieve.compress, kvsieve.generate or (under "
    "kvsieve.apply) model.generate, which then read the sentences; or use projection=topk or projection=chunk"
)


class Projection(Protocol):
    """Turns one layer's scores and per-head keep counts into the kept entries of each kv-head."""

    name: ClassVar[str]
    #: whether `pick` reads caller-given `spans` (and refuses to run without them)
    needs_spans: ClassVar[bool]

    def pick(
        self,
        scores: torch.Tensor,
        protected: torch.Tensor,
        evictable: torch.Tensor,
        counts: Sequence[int],
        positions: torch.Tensor,
        spans: torch.Tensor | None,
    ) -> list[torch.Tensor]:
        """Sorted kept indices per kv-head: every protected entry plus exactly `counts[h]` evictable ones.

        Args:
            scores: `[kv_heads, n]`, higher = keep. protected, evictable: `[kv_heads, n]` bool.
            counts: evictable entries each kv-head keeps (the allocator's).
            positions: `[kv_heads, n]` token positions of the entries (`Observation.positions`).
            spans: `[n_tokens]` span id per token position of the sequence, or None.
        """
        ...


@dataclass(frozen=True)
class TopK:
    """The best-scored evictable entries of each head, one by one (`allocators.top_scored`)."""

    name: ClassVar[str] = "topk"
    needs_spans: ClassVar[bool] = False

    def pick(
        self,
        scores: torch.Tensor,
        protected: torch.Tensor,
        evictable: torch.Tensor,
        counts: Sequence[int],
        positions: torch.Tensor,
        spans: torch.Tensor | None,
    ) -> list[torch.Tensor]:
        return top_scored(scores, protected, evictable, counts)


@dataclass(frozen=True)
class Chunks:
    """ChunkKV (arXiv 2502.00299): whole chunks of `chunk_size` token positions (`position // chunk_size`).

    Spans come from the entries' token positions, so an already-evicted (ragged) cache keeps its
    chunks' surviving entries together. Span selection as in the module docstring.
    """

    name: ClassVar[str] = "chunk"
    needs_spans: ClassVar[bool] = False
    chunk_size: int = DEFAULT_CHUNK_SIZE
    best_tokens: float = DEFAULT_BEST_TOKENS

    def __post_init__(self) -> None:
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise PolicyError(f"chunk_size must be an integer >= 1, got {self.chunk_size!r}")
        check_best_tokens(self.best_tokens)

    def pick(
        self,
        scores: torch.Tensor,
        protected: torch.Tensor,
        evictable: torch.Tensor,
        counts: Sequence[int],
        positions: torch.Tensor,
        spans: torch.Tensor | None,
    ) -> list[torch.Tensor]:
        chunks = positions.div(self.chunk_size, rounding_mode="floor")
        return pick_spans(scores, protected, evictable, counts, chunks, self.best_tokens)


@dataclass(frozen=True)
class Sentences:
    """Whole caller-given spans (e.g. sentences): `spans[p]` is the span of token position `p`.

    Positions past the end of `spans` (tokens that came later, such as generated ones) each form
    their own span. Span selection as in the module docstring.
    """

    name: ClassVar[str] = "sentence"
    needs_spans: ClassVar[bool] = True
    best_tokens: float = DEFAULT_BEST_TOKENS

    def __post_init__(self) -> None:
        check_best_tokens(self.best_tokens)

    def pick(
        self,
        scores: torch.Tensor,
        protected: torch.Tensor,
        evictable: torch.Tensor,
        counts: Sequence[int],
        positions: torch.Tensor,
        spans: torch.Tensor | None,
    ) -> list[torch.Tensor]:
        if spans is None:
            raise PolicyError(MISSING_SPANS)
        return pick_spans(scores, protected, evictable, counts, span_ids(positions, spans), self.best_tokens)


PROJECTIONS: dict[str, type] = {cls.name: cls for cls in (TopK, Chunks, Sentences)}


def projection_record(projection: Projection) -> dict[str, object]:
    """A projection as plain data, as a gate checkpoint records it: ``{"name": "sentence", "best_tokens": 0.1}``."""
    return {"name": projection.name, **dataclasses.asdict(projection)}


def from_record(record: Mapping[str, object]) -> Projection:
    """The projection of `projection_record`'s data, or a `PolicyError` that names what is wrong with it."""
    if not isinstance(record, Mapping):
        raise PolicyError(f"a projection is recorded as {{'name': ..., parameters}}, got {record!r}")
    params = dict(record)
    name = params.pop("name", None)
    if name not in PROJECTIONS:
        raise PolicyError(f"unknown projection {name!r}; known: {', '.join(PROJECTIONS)}")
    try:
        return PROJECTIONS[name](**params)
    except TypeError as err:
        raise PolicyError(f"projection {name}: {err}") from None


def check_best_tokens(fraction: float) -> None:
    """A clear error for a `best_tokens` that is not a number in [0, 1)."""
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 <= fraction < 1:
        raise PolicyError(f"best_tokens must be a number in [0, 1) (1 would be projection=topk), got {fraction!r}")


def check_spans(spans: torch.Tensor | None) -> None:
    """A clear error for spans that are not a 1-D integer tensor (a span id per token position)."""
    if spans is None:
        return
    if not isinstance(spans, torch.Tensor):
        raise PolicyError(f"spans must be a 1-D integer tensor (a span id per token position), got {type(spans)}")
    if spans.ndim != 1 or spans.is_floating_point() or spans.dtype == torch.bool:
        what = f"a tensor of shape {tuple(spans.shape)} and dtype {spans.dtype}"
        raise PolicyError(f"spans must be a 1-D integer tensor (a span id per token position), got {what}")


def span_ids(positions: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """The span id of every entry: `spans[position]`, or a span of its own past the end of `spans`."""
    spans = spans.to(device=positions.device, dtype=torch.long)
    n = spans.numel()
    beyond = positions - n + (int(spans.max()) + 1 if n else 0)
    if not n:
        return beyond
    return torch.where(positions < n, spans[positions.clamp(0, n - 1)], beyond)


def pick_spans(
    scores: torch.Tensor,
    protected: torch.Tensor,
    evictable: torch.Tensor,
    counts: Sequence[int],
    spans: torch.Tensor,
    best_tokens: float = DEFAULT_BEST_TOKENS,
) -> list[torch.Tensor]:
    """Sorted indices kept per kv-head: every protected entry plus `counts[h]` evictable ones, taken span by span.

    Per head: its best-scored `best_tokens` fraction of the evictable entries first, at most `count`
    (equal scores: the earlier); then, among the evictable entries left, spans rank by the mean
    score of their entries (ties: earlier first entry); each that fits whole in what is left of the
    count is taken, the others skipped; what is left when none fits comes from the best-ranked
    unused span's best-scored entries (one span cut at most).

    Args:
        scores: `[kv_heads, n]`, higher = keep. protected, evictable: `[kv_heads, n]` bool.
        spans: `[kv_heads, n]` the span id of every entry.
    """
    if torch.isnan(scores[evictable]).any():
        raise ValueError("scores must not be NaN")
    out = []
    for h, count in enumerate(counts):
        first = min(int(count), round(best_tokens * int(evictable[h].sum())))
        singles = best_entries(scores[h], evictable[h], first)
        left = evictable[h].clone()
        left[singles] = False
        kept = head_spans(scores[h], left, spans[h], int(count) - singles.numel())
        out.append(torch.cat([protected[h].nonzero().flatten(), singles, kept]).sort().values)
    return out


def best_entries(scores: torch.Tensor, evictable: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of one head's `count` best-scored evictable entries (equal scores: the earlier entry)."""
    index = evictable.nonzero().flatten()
    return index[scores[index].sort(descending=True, stable=True).indices[:count]]


def head_spans(scores: torch.Tensor, evictable: torch.Tensor, spans: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` evictable entries one head keeps, by the span selection rule (module docstring)."""
    index = evictable.nonzero().flatten()
    if not 0 <= count <= index.numel():
        raise ValueError(f"cannot keep {count} of {index.numel()} evictable entries")
    if count in (0, index.numel()):
        return index[:count]
    values = scores[index].double()
    ids, member = torch.unique(spans[index], return_inverse=True)
    n_spans = ids.numel()
    size = torch.bincount(member, minlength=n_spans)
    mean = values.new_zeros(n_spans).index_add_(0, member, values) / size
    mean = mean.masked_fill(mean.isnan(), float("-inf"))  # a span holding both +inf and -inf
    entry = torch.arange(index.numel(), device=index.device)
    first = torch.full_like(size, index.numel()).scatter_reduce_(0, member, entry, "amin")
    by_first = first.argsort()
    order = by_first[mean[by_first].sort(descending=True, stable=True).indices]
    taken, left = fit_spans(size[order].cpu(), count)
    chosen = torch.zeros(n_spans, dtype=torch.bool, device=index.device)
    chosen[order[taken.to(index.device)]] = True
    keep = chosen[member]
    if left:
        cut = order[int((~taken).nonzero()[0])]  # the best-ranked unused span
        inside = (member == cut).nonzero().flatten()
        keep[inside[values[inside].sort(descending=True, stable=True).indices[:left]]] = True
    return index[keep]


def fit_spans(sizes: torch.Tensor, count: int) -> tuple[torch.Tensor, int]:
    """Walk spans of `sizes` in rank order, taking each that fits whole in what is left of `count`.

    Returns which spans were taken and how many entries are left to fill.
    """
    taken = torch.zeros_like(sizes, dtype=torch.bool)
    left, start = count, 0
    while left > 0 and start < sizes.numel():
        rest = sizes[start:]
        run = int((rest.cumsum(0) <= left).sum())  # the leading spans that fit together
        if run:
            taken[start : start + run] = True
            left -= int(rest[:run].sum())
            start += run
            continue
        fits = (rest <= left).nonzero().flatten()
        if not fits.numel():
            break
        start += int(fits[0])
        taken[start] = True
        left -= int(sizes[start])
        start += 1
    return taken, left
