"""The observation contract: what a scorer may look at for one layer of one sequence, and what it declares it reads.

A scorer declares what it reads besides the entries (`Needs`); the runtime records exactly that,
once, for every layer and sequence (an observed prefill, `kvsieve.runtime.prefill`), or builds it
from a cache that was already evicted (`kvsieve.runtime.cache_observations`): every kv-head then has
its own entries, padded to the longest head and marked by `valid`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .gates import RetentionGates
from .rotary import Rotary

#: Queries at the end of the context that window scorers read by default.
DEFAULT_WINDOW = 32


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
    """

    window: int = 0
    accumulated: bool = False
    output_projection: bool = False
    rotary: bool = False
    gates: tuple[str, ...] = ()
    reconstruction: Reconstruction | None = None

    def __or__(self, other: Needs) -> Needs:
        mine, theirs = self.reconstruction, other.reconstruction
        if mine is not None and theirs is not None and mine != theirs:
            raise ValueError(f"one prefill cannot reconstruct its context two ways: {mine} and {theirs}")
        return Needs(
            window=max(self.window, other.window),
            accumulated=self.accumulated or other.accumulated,
            output_projection=self.output_projection or other.output_projection,
            rotary=self.rotary or other.rotary,
            gates=tuple(sorted({*self.gates, *other.gates})),
            reconstruction=mine or theirs,
        )


@dataclass(frozen=True)
class Statistics:
    """What an observed prefill recorded for one layer of one sequence.

    Attributes:
        scaling: the layer's softmax scale.
        q_heads: query heads of the layer.
        window_queries: `[q_heads, w, head_dim]` the last `w` queries, after RoPE, float32 (None if not needed).
        window_positions: `[w]` their token positions.
        received: `[q_heads, n]` attention each entry received, summed over all queries (None if not needed).
        output_weight: the layer's output projection `[hidden, q_heads * head_dim]` (None if not needed).
        gates: the retention gates the scorers read, by source (`Needs.gates`).
        reconstructed: `[q_heads, n]` the most attention each entry received while the model repeated
            the context (`Needs.reconstruction`; None if not needed).
    """

    scaling: float
    q_heads: int
    window_queries: torch.Tensor | None = None
    window_positions: torch.Tensor | None = None
    received: torch.Tensor | None = None
    output_weight: torch.Tensor | None = None
    gates: Mapping[str, RetentionGates] = dataclasses.field(default_factory=dict)
    reconstructed: torch.Tensor | None = None


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
        stats: what the prefill recorded (see `Statistics`).
        rotary: the model's rotary embedding, if a scorer needs it.
        seen: tokens the sequence has seen, when its entries are not all of them (an evicted cache).
    """

    layer_idx: int
    num_layers: int
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor | None
    stats: Statistics
    rotary: Rotary | None = None
    seen: int | None = None

    @property
    def num_kv_heads(self) -> int:
        return int(self.keys.shape[0])

    @property
    def length(self) -> int:
        return int(self.keys.shape[1])

    @property
    def group(self) -> int:
        """Query heads per kv-head."""
        return self.stats.q_heads // self.num_kv_heads

    @property
    def entry_bytes(self) -> int:
        """Bytes of one entry's key and value."""
        return entry_bytes(self.keys, self.values)

    @property
    def scaling(self) -> float:
        return self.stats.scaling

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
        recorded = self.stats.window_queries
        if recorded is None or window > recorded.shape[1]:
            have = 0 if recorded is None else recorded.shape[1]
            raise ValueError(f"window={window} needs the last {window} prefill queries; {have} were recorded")
        return recorded[:, -window:], self.stats.window_positions[-window:]

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
