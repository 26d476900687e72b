"""The observation contract: what a scorer may look at for one layer of one sequence, and what it declares it reads.

A scorer declares what it reads besides the entries (`Needs`); the runtime records exactly that,
once, for every layer and sequence (an observed prefill, `kvsieve.runtime.observing.prefill`), or builds it
from a cache that was already evicted (`kvsieve.runtime.observing.cache_observations`): every kv-head then
has its own entries, padded to the longest head and marked by `valid`.

What an observation holds comes in two kinds: `LayerFacts`, fixed by the model (softmax scale, query
heads, `W_o`, retention gates), and `Statistics`, measured while the model ran (the last queries and
what each yielded, the attention each entry received, KVzip's reconstruction). The list of per-query
measurements is open: a scorer that needs something every query yields declares a `QueryMeasure`
in its own file (`Needs.measures`), and the runtime records it at the prefill and while decoding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ..modeling.gates import RetentionGates
    from ..modeling.rotary import Rotary

#: Queries at the end of the context that window scorers read by default.
DEFAULT_WINDOW = 32


class QueryMeasure(Protocol):
    """Something every query of an attention layer yields, of which scorers read the last `Needs.window`.

    Recorded by the runtime at the prefill and at every later forward (a bounded cache), per layer and
    sequence. A measure that reads the output is kept valid: after every eviction the runtime measures
    it again on each window query's output over the entries the cache then holds.
    """

    #: the key `Observation.measured` reads it by
    name: str
    #: whether it reads the attention output (measured again after an eviction) or the query alone
    reads_output: bool

    def measure(self, query: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """`[rows, q_heads, q, k]` from the queries (after RoPE) `[rows, q_heads, q, d]` and their attention
        outputs `[rows, q_heads, q, dv]` (before `W_o`)."""
        ...


@dataclass(frozen=True)
class WindowQueries:
    """The queries themselves, after RoPE, in float32: what every window scorer reads."""

    name: str = "queries"
    reads_output: bool = False

    def measure(self, query: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        return query.detach().float()


QUERIES = WindowQueries()


def entry_bytes(keys: torch.Tensor, values: torch.Tensor) -> int:
    """Bytes of one entry's key and value (`[..., head_dim]` tensors)."""
    return keys.shape[-1] * keys.element_size() + values.shape[-1] * values.element_size()


@dataclass(frozen=True)
class Reconstruction:
    """The model repeating its own context after it, as KVzip scores entries (arXiv 2505.23416).

    After the prefill, `prompt` (in the tokenizer's chat template where it has one) and the context
    are fed after the context, `chunk` context tokens at a time, each chunk on the prefilled cache
    alone; every entry records the most attention any of those queries gave it.
    """

    prompt: str
    chunk: int


@dataclass(frozen=True)
class Needs:
    """What a scorer reads besides the entries' keys, values and positions.

    Attributes:
        window: how many of the last prefill queries (after RoPE) it reads.
        accumulated: whether it reads the attention each entry received from all prefill queries
            (costs a materialised softmax instead of fused SDPA during the prefill).
        output_projection: whether it reads the attention output projection `W_o`.
        rotary: whether it reads the model's rotary embedding.
        gates: the retention-gate checkpoints it reads (`kvsieve.selection.checkpoint.load_gates` sources).
        reconstruction: whether, and how, the model repeats its context after the prefill (`Reconstruction`).
        measures: what else each of the last `window` queries yields that it reads (`QueryMeasure`; the
            queries themselves are always recorded with a window).
    """

    window: int = 0
    accumulated: bool = False
    output_projection: bool = False
    rotary: bool = False
    gates: tuple[str, ...] = ()
    reconstruction: Reconstruction | None = None
    measures: tuple[QueryMeasure, ...] = ()

    def __post_init__(self) -> None:
        if self.measures and not self.window:
            raise ValueError("query measures are recorded for the last `window` queries: give a window >= 1")

    @property
    def window_measures(self) -> tuple[QueryMeasure, ...]:
        """The measures of the window queries to record: the queries, then the declared ones (none without a window)."""
        return (QUERIES, *self.measures) if self.window else ()

    def __or__(self, other: Needs) -> Needs:
        mine, theirs = self.reconstruction, other.reconstruction
        if mine is not None and theirs is not None and mine != theirs:
            raise ValueError(f"one prefill cannot reconstruct its context two ways: {mine} and {theirs}")
        measures = {m.name: m for m in self.measures}
        for measure in other.measures:
            if measures.setdefault(measure.name, measure) != measure:
                raise ValueError(f"two query measures are named {measure.name!r}: {measures[measure.name]}, {measure}")
        return Needs(
            window=max(self.window, other.window),
            accumulated=self.accumulated or other.accumulated,
            output_projection=self.output_projection or other.output_projection,
            rotary=self.rotary or other.rotary,
            gates=tuple(sorted({*self.gates, *other.gates})),
            reconstruction=mine or theirs,
            measures=tuple(measures.values()),
        )


@dataclass(frozen=True)
class LayerFacts:
    """What the model fixes about one layer, the same for every sequence.

    Attributes:
        scaling: the layer's softmax scale.
        q_heads: query heads of the layer.
        output_weight: the layer's output projection `[hidden, q_heads * head_dim]` (None if not needed).
        gates: the retention gates the scorers read, by source (`Needs.gates`).
    """

    scaling: float
    q_heads: int
    output_weight: torch.Tensor | None = None
    gates: Mapping[str, RetentionGates] = field(default_factory=dict)


@dataclass(frozen=True)
class Statistics:
    """What was measured for one layer of one sequence while the model ran.

    Attributes:
        window: `[q_heads, w, k]` what each of the last `w` queries yielded, by `QueryMeasure.name` (empty if no
            window is needed).
        window_positions: `[w]` their token positions.
        received: `[q_heads, n]` attention each entry received, summed over all queries (None if not needed).
        reconstructed: `[q_heads, n]` the most attention each entry received while the model repeated
            the context (`Needs.reconstruction`; None if not needed).
    """

    window: Mapping[str, torch.Tensor] = field(default_factory=dict)
    window_positions: torch.Tensor | None = None
    received: torch.Tensor | None = None
    reconstructed: torch.Tensor | None = None

    @property
    def window_queries(self) -> torch.Tensor | None:
        """`[q_heads, w, head_dim]` the last `w` queries, after RoPE, float32 (None if not recorded)."""
        return self.window.get(QUERIES.name)


#: Nothing measured: an observation built from a cache alone.
NOTHING_MEASURED = Statistics()


def causal_attention(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention `[heads, q, n]` of `queries [heads, q, d]` over `keys [heads, n, d]`.

    A query sees the valid keys at or before its own position (`key_positions`: `[n]` or `[heads, n]`).
    """
    scores = (queries.float() @ keys.float().transpose(-1, -2)) * scaling
    hidden = key_positions[..., None, :] > query_positions[..., :, None]
    if valid is not None:
        hidden = hidden | ~valid[..., None, :]
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)


@dataclass(frozen=True)
class Observation:
    """What a scorer may look at for one layer of one sequence.

    Attributes:
        layer_idx, num_layers: where the layer sits in the model.
        keys: `[kv_heads, n, head_dim]` keys after RoPE.
        values: `[kv_heads, n, head_dim]` values.
        positions: `[kv_heads, n]` token positions of the entries, increasing along each head (-1 where
            no entry is).
        valid: `[kv_heads, n]` which entries exist, or None when all do (heads of an evicted
            cache hold different numbers of entries and are padded to the longest).
        facts: what the model fixes about the layer (see `LayerFacts`).
        stats: what was measured while the model ran (see `Statistics`).
        rotary: the model's rotary embedding, if a scorer needs it.
        seen: tokens the sequence has seen, when its entries are not all of them (an evicted cache).
        bounded: whether the cache is held at a size as the sequence grows, so this eviction is one of many
            (a chunked prefill, generation with a `buffer`, vLLM with `max_tokens` and `buffer`); False when a
            prompt is compressed once.
    """

    layer_idx: int
    num_layers: int
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor | None
    facts: LayerFacts
    stats: Statistics = NOTHING_MEASURED
    rotary: Rotary | None = None
    seen: int | None = None
    bounded: bool = False

    @property
    def num_kv_heads(self) -> int:
        return int(self.keys.shape[0])

    @property
    def length(self) -> int:
        return int(self.keys.shape[1])

    @property
    def group(self) -> int:
        """Query heads per kv-head."""
        return self.facts.q_heads // self.num_kv_heads

    @property
    def entry_bytes(self) -> int:
        """Bytes of one entry's key and value."""
        return entry_bytes(self.keys, self.values)

    @property
    def scaling(self) -> float:
        return self.facts.scaling

    @property
    def valid_mask(self) -> torch.Tensor:
        """`[kv_heads, n]` bool: which entries exist."""
        if self.valid is None:
            return torch.ones(self.keys.shape[:2], dtype=torch.bool, device=self.keys.device)
        return self.valid

    def received(self, who: str) -> torch.Tensor:
        """`[q_heads, n]` attention each entry received from every query so far, or a clear error."""
        if self.stats.received is None:
            raise ValueError(f"{who} needs the attention accumulated over all queries (Needs.accumulated)")
        return self.stats.received

    def reconstructed(self, who: str) -> torch.Tensor:
        """`[q_heads, n]` the most attention each entry received while the model repeated the context."""
        if self.stats.reconstructed is None:
            raise ValueError(
                f"{who} reads the model repeating its context after the prefill (Needs.reconstruction), which "
                "only a prefill records: not a chunked prefill or a cache re-scored during generation"
            )
        return self.stats.reconstructed

    def queries_seeing(self) -> torch.Tensor:
        """`[kv_heads, n]` how many queries could attend to each entry (every token seen is a query)."""
        seen = self.valid_mask.sum(dim=-1, keepdim=True) if self.seen is None else self.seen
        return (seen - self.positions).clamp(min=1)

    def queries(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last `window` recorded queries `[q_heads, w, d]` and their positions `[w]`."""
        return self.measured(QUERIES, window), self.stats.window_positions[-window:]

    def measured(self, measure: QueryMeasure, window: int) -> torch.Tensor:
        """`[q_heads, w, k]` what each of the last `window` queries yielded (`Needs.measures`), or a clear error."""
        recorded = self.stats.window.get(measure.name)
        if recorded is None or window > recorded.shape[1]:
            have = 0 if recorded is None else recorded.shape[1]
            what = "prefill queries" if measure.name == QUERIES.name else f"queries' {measure.name}"
            raise ValueError(f"window={window} needs the last {window} {what}; {have} were recorded")
        return recorded[:, -window:]

    def window_attention(self, window: int) -> torch.Tensor:
        """`[q_heads, w, n]` attention probabilities of the last `window` queries (exact, recomputed)."""
        queries, query_positions = self.queries(window)
        keys = self.keys.repeat_interleave(self.group, dim=0)
        positions = self.positions.repeat_interleave(self.group, dim=0)
        valid = None if self.valid is None else self.valid.repeat_interleave(self.group, dim=0)
        return causal_attention(queries, query_positions, keys, positions, self.scaling, valid)

    def per_kv_head(self, per_query_head: torch.Tensor) -> torch.Tensor:
        """Sum a `[q_heads, ...]` statistic over the query heads that share each kv-head."""
        return per_query_head.unflatten(0, (self.num_kv_heads, -1)).sum(dim=1)
