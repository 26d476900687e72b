"""Merges: what a head evicts lives on as merged entries (a key, a value and a logit bias each), not as nothing.

Evicting an entry removes its share of the softmax: the kept entries' weights grow and the output
moves, even where the evicted entries were individually unimportant. A merge folds every entry a
(layer, kv-head) evicts into one merged entry whose attention logit carries a bias, so the mass of
the evicted entries stays in the softmax and their values stay in the output, approximately:

- `MeanMerge` (``merge=mean``): the mean key and mean value with the bias `log n` for `n` merged entries,
  proportional attention as token merging weighs a merged token (ToMe, arXiv 2210.09461).
- `WindowMerge` (``merge=window``): weighted by the attention the last prompt queries (the observation
  window, as SnapKV's, arXiv 2404.14469) paid the evicted entries, with the bias that makes the merged
  entry's logit match their log-sum-exp for those queries on average.
- `OutputMerge` (``merge=output``): `WindowMerge`'s key and value with the bias that best reproduces those
  queries' attention outputs (least squares).

With ``parts=m`` each head's evicted entries fall into `m` groups of similar keys (k-means, `key_groups`) and each
group becomes a merged entry of its own: one averaged value stands for fewer, more alike entries, and every query
weighs the groups apart (entries sharing a key merge exactly, `m` keys or not). The merged entries, stored in the
model's dtype, take as many of the head's kept slots as their bytes fill (`Policy.select`: `m` in full precision),
so a budget holds as many bytes with a merge as without.

A policy that names no merge uses the one its gates' checkpoint records, if any (`RetentionGates.merge`);
``merge=none`` (`NO_MERGE`) keeps none. A merge summarizes one eviction of a prompt: a cache that evicts again as
it grows (a `buffer` or `chunk`, the vLLM plugin) refuses a policy that names one and does without the recorded one
(`Policy.evicting_again`).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from .errors import PolicyError
from .fields import changed_fields
from .observation import Needs, Observation

if TYPE_CHECKING:
    from ..modeling.gates import RetentionGates

#: Why a cache that evicts again as it grows refuses a policy that merges.
MERGE_ONCE = (
    "{policy} folds what each head evicts into merged entries, which summarize one eviction of a prompt; a cache "
    "that evicts again as it grows (buffer=, chunk=, the vLLM plugin) cannot keep it true: drop merge= from the "
    "policy there"
)


@dataclass(frozen=True)
class Merged:
    """One layer's merged entries for one sequence: per kv-head `m` keys `[kv_heads, m, d]`, values `[kv_heads, m, d]`
    and logit biases `[kv_heads, m]` (float32; -inf for a part that holds nothing)."""

    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor


class Merge(Protocol):
    """Folds a head's evicted entries into `parts` merged entries (one per group of similar keys, `key_groups`)."""

    name: ClassVar[str]
    #: merged entries per head
    parts: int

    @property
    def needs(self) -> Needs:
        """What the observed prefill must record for it."""
        ...

    def weights(self, obs: Observation, head: int, evicted: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Weights `[n]` (summing to 1) of the head's evicted entries (indices `evicted [n]`) and the logit bias."""
        ...


def merge_evicted(merge: Merge, obs: Observation, kept: Sequence[torch.Tensor]) -> Merged:
    """The merged entries of one layer: every valid entry of a head that `kept[head]` does not name, folded, in
    `merge.parts` groups of similar keys."""
    heads, parts, device = obs.num_kv_heads, merge.parts, obs.keys.device
    keys = torch.zeros(heads, parts, obs.keys.shape[-1], dtype=torch.float32, device=device)
    values = torch.zeros(heads, parts, obs.values.shape[-1], dtype=torch.float32, device=device)
    bias = torch.full((heads, parts), float("-inf"), device=device)
    for head in range(heads):
        evicted = obs.valid_mask[head].clone()
        evicted[kept[head].to(evicted.device)] = False
        index = evicted.nonzero().flatten()
        for part, group in enumerate(key_groups(obs.keys[head, index].float(), parts)):
            weights, bias[head, part] = merge.weights(obs, head, index[group])
            keys[head, part] = weights @ obs.keys[head, index[group]].float()
            values[head, part] = weights @ obs.values[head, index[group]].float()
    return Merged(keys, values, bias)


def check_parts(parts: object) -> None:
    """A clear error unless `parts` (merged entries per head) is a whole number >= 1."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise PolicyError(f"parts (merged entries per head) must be a whole number >= 1, got {parts!r}")


def key_groups(keys: torch.Tensor, parts: int, rounds: int = 10) -> list[torch.Tensor]:
    """Indices of `keys [n, d]` in at most `parts` non-empty groups of similar keys (k-means, `rounds` Lloyd steps from
    keys spread over the order they come in; deterministic); one group for `parts` 1, none for no keys."""
    n = keys.shape[0]
    if n == 0:
        return []
    if parts == 1 or n <= parts:
        order = torch.arange(n, device=keys.device)
        return [order] if parts == 1 else list(order[:, None])
    centres = keys[torch.linspace(0, n - 1, parts, device=keys.device).round().long()]
    for _ in range(rounds):
        nearest = torch.cdist(keys, centres).argmin(-1)
        counts = torch.bincount(nearest, minlength=parts)
        sums = torch.zeros_like(centres).index_add_(0, nearest, keys)
        centres = torch.where(counts[:, None] > 0, sums / counts.clamp(min=1)[:, None], centres)
    nearest = torch.cdist(keys, centres).argmin(-1)
    return [group for group in (torch.nonzero(nearest == part).flatten() for part in range(parts)) if group.numel()]


@dataclass(frozen=True)
class MeanMerge:
    """The evicted entries' mean key and mean value, their logit raised by `log n` (ToMe's proportional attention)."""

    name: ClassVar[str] = "mean"
    parts: int = 1

    def __post_init__(self) -> None:
        check_parts(self.parts)

    @property
    def needs(self) -> Needs:
        return Needs()

    def weights(self, obs: Observation, head: int, evicted: torch.Tensor) -> tuple[torch.Tensor, float]:
        n = evicted.numel()
        return torch.full((n,), 1.0 / n, device=evicted.device), math.log(n)


@dataclass(frozen=True)
class WindowMerge:
    """The evicted entries weighted by the last prompt queries' attention, with a fitted logit bias.

    The weights: the softmax of the last `WINDOW` queries of the head's group over the evicted entries, averaged;
    the bias makes the merged logit match their log-sum-exp for those queries, on average.

    A head none of whose window queries sees an evicted entry merges them as `MeanMerge` does.
    """

    name: ClassVar[str] = "window"
    WINDOW: ClassVar[int] = 32
    parts: int = 1

    def __post_init__(self) -> None:
        check_parts(self.parts)

    @property
    def needs(self) -> Needs:
        return Needs(window=self.WINDOW)

    def window_logits(
        self, obs: Observation, head: int, entries: torch.Tensor | slice = slice(None)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last `WINDOW` prompt queries of the head's group `[q, d]` (float32) and their logits `[q, n]` over the
        head's `entries` (all by default), -inf where an entry comes after the query."""
        window = min(self.WINDOW, obs.stats.window_queries.shape[1])  # a prompt shorter than the window has fewer
        queries, positions = obs.queries(window)
        group = queries.shape[0] // obs.num_kv_heads
        mine = queries[head * group : (head + 1) * group].reshape(-1, queries.shape[-1]).float()
        logits = (mine @ obs.keys[head, entries].float().T) * obs.scaling
        later = obs.positions[head, entries][None, :] > positions.to(obs.keys.device).repeat(group)[:, None]
        return mine, logits.masked_fill(later, float("-inf"))

    def weights(self, obs: Observation, head: int, evicted: torch.Tensor) -> tuple[torch.Tensor, float]:
        queries, logits = self.window_logits(obs, head, evicted)
        return self.fold(obs, head, evicted, queries, logits)

    def fold(
        self, obs: Observation, head: int, evicted: torch.Tensor, queries: torch.Tensor, logits: torch.Tensor
    ) -> tuple[torch.Tensor, float]:
        """The weights and the bias from the window `queries`' `logits` over the evicted entries (`window_logits`)."""
        seeing = ~torch.isneginf(logits).all(-1)
        if not bool(seeing.any()):
            return MeanMerge().weights(obs, head, evicted)
        logits = logits[seeing]
        weights = torch.softmax(logits, -1).mean(0)
        merged_logits = (queries[seeing] @ (weights @ obs.keys[head, evicted].float())) * obs.scaling
        return weights, float((torch.logsumexp(logits, -1) - merged_logits).mean())


@dataclass(frozen=True)
class OutputMerge(WindowMerge):
    """`WindowMerge`'s key and value, with the logit bias that best reproduces the window queries' outputs.

    `WindowMerge`'s bias restores the evicted entries' share of the softmax; where their values disagree, the one
    averaged value then takes a share it does not deserve. This bias minimizes, over the last `WINDOW` queries of
    the head's group, the squared difference between each query's attention output over all the head's entries and
    its output over the kept ones plus the merged one. It is searched among `OFFSETS` from `WindowMerge`'s bias
    (the lowest leaves the merged entry about 1/3000 of the share it restores). In parts, each group's bias is fitted
    with the other groups' entries still in place.
    """

    name: ClassVar[str] = "output"
    OFFSETS: ClassVar[tuple[float, ...]] = tuple(-8.0 + 0.125 * step for step in range(81))

    def weights(self, obs: Observation, head: int, evicted: torch.Tensor) -> tuple[torch.Tensor, float]:
        queries, logits = self.window_logits(obs, head)  # over every entry, once
        logits = logits.masked_fill(~obs.valid_mask[head][None, :], float("-inf"))
        weights, restoring = self.fold(obs, head, evicted, queries, logits[:, evicted])
        keys, values = obs.keys[head, evicted].float(), obs.values[head].float()
        before = torch.softmax(logits, -1) @ values
        gone = torch.zeros_like(obs.valid_mask[head])
        gone[evicted] = True
        kept_logits = logits.masked_fill(gone[None, :], float("-inf"))
        kept = torch.softmax(kept_logits, -1).nan_to_num() @ values  # a query that sees no kept entry: zeros
        merged_logit = (queries @ (weights @ keys)) * obs.scaling
        bias = restoring + torch.tensor(self.OFFSETS, device=queries.device)
        share = torch.sigmoid(merged_logit + bias[:, None] - torch.logsumexp(kept_logits, -1))  # [offsets, queries]
        after = kept + share[..., None] * (weights @ values[evicted] - kept)
        error = (after - before).square().sum(-1).mean(-1)
        return weights, float(bias[int(error.argmin())])


@dataclass(frozen=True)
class NoMerge:
    """What a head evicts is dropped, whatever merge the checkpoint of the gates the policy reads records."""

    name: ClassVar[str] = "none"
    parts: ClassVar[int] = 0

    @property
    def needs(self) -> Needs:
        return Needs()

    def weights(self, obs: Observation, head: int, evicted: torch.Tensor) -> tuple[torch.Tensor, float]:
        raise TypeError("merge=none folds nothing: a policy naming it merges no entry")


#: The merge a policy names to keep none (``merge=none``).
NO_MERGE = NoMerge()

#: Merges by the name a policy spec gives them (``merge=NAME``).
MERGES: dict[str, type[Merge]] = {cls.name: cls for cls in (MeanMerge, WindowMerge, OutputMerge, NoMerge)}


def folds(merge: Merge | None) -> bool:
    """Whether `merge` folds what a head evicts (not None, not ``merge=none``)."""
    return merge is not None and merge != NO_MERGE


def recorded_merge_needs(gates: Iterable[RetentionGates]) -> Needs:
    """What the merges recorded in the checkpoints of `gates` read (a policy naming no merge folds with its gates'
    one, `Policy.merged`), so that whatever observes the prompt records it too."""
    return functools.reduce(operator.or_, (g.merge.needs for g in gates if folds(g.merge)), Needs())


def make_merge(choice: object, **params: object) -> Merge | None:
    """The merge `choice` names with `params` (a name in `MERGES`; a record, `merge_record`; or a `Merge` as is);
    None for None or ""."""
    if isinstance(choice, Mapping):
        params, choice = {k: v for k, v in choice.items() if k != "name"} | params, choice.get("name")
    if choice is None or choice == "":
        if params:
            raise PolicyError(f"{', '.join(params)} is a parameter of a merge; the policy names none")
        return None
    if not isinstance(choice, str):
        return choice
    if choice not in MERGES:
        raise PolicyError(f"unknown merge {choice!r}; known: {', '.join(MERGES)}")
    try:
        return MERGES[choice](**params)
    except TypeError as err:
        raise PolicyError(f"merge={choice}: {err}") from None


def merge_record(merge: Merge) -> str | dict[str, object]:
    """A merge as a gate checkpoint records it: its name, with the parameters it does not leave at their defaults."""
    changed = changed_fields(merge)
    return {"name": merge.name, **changed} if changed else merge.name
