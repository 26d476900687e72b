"""Observations: what a scorer may look at for one layer of one sequence, and the observed prefill that makes them.

A scorer declares what it reads besides the entries (`Needs`); an observed prefill records exactly
that, once, for every layer and sequence (`PrefillRecorder`, fed by sieve attention). An observation
can also be built from a cache that was already evicted (`observe_cache`): every kv-head then has
its own entries, padded to the longest head and marked by `valid`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from .attention import UnhookableModelError, sieve_attention
from .cache import SievedCache, SievedLayer
from .learn.checkpoint import load_gates
from .learn.gates import RetentionGates
from .rotary import Rotary, find_rotary
from .segments import PAD_POSITION, entry_bytes

#: Queries at the end of the context that window scorers read by default.
DEFAULT_WINDOW = 32


@dataclass(frozen=True)
class Needs:
    """What a scorer reads besides the entries' keys, values and positions.

    Attributes:
        window: how many of the last prefill queries (after RoPE) it reads.
        accumulated: whether it reads the attention each entry received from all prefill queries
            (costs a materialised softmax instead of fused SDPA during the prefill).
        output_projection: whether it reads the attention output projection `W_o`.
        rotary: whether it reads the model's rotary embedding.
        gates: the retention-gate checkpoints it reads (`kvsieve.learn.checkpoint.load_gates` sources).
    """

    window: int = 0
    accumulated: bool = False
    output_projection: bool = False
    rotary: bool = False
    gates: tuple[str, ...] = ()

    def __or__(self, other: Needs) -> Needs:
        return Needs(
            window=max(self.window, other.window),
            accumulated=self.accumulated or other.accumulated,
            output_projection=self.output_projection or other.output_projection,
            rotary=self.rotary or other.rotary,
            gates=tuple(sorted({*self.gates, *other.gates})),
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
    """

    scaling: float
    q_heads: int
    window_queries: torch.Tensor | None = None
    window_positions: torch.Tensor | None = None
    received: torch.Tensor | None = None
    output_weight: torch.Tensor | None = None
    gates: Mapping[str, RetentionGates] = dataclasses.field(default_factory=dict)


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


def needed_gates(model: torch.nn.Module, needs: Needs) -> dict[str, RetentionGates]:
    """The retention gates `needs` names, loaded and checked against `model`."""
    return {source: load_gates(source, model) for source in needs.gates}


def output_projection(module: torch.nn.Module) -> torch.Tensor:
    """The attention output projection weight `[hidden, q_heads * head_dim]`, or a clear error."""
    projection = getattr(module, "o_proj", None)
    if not isinstance(projection, torch.nn.Linear):
        raise ValueError(f"{type(module).__name__} has no output projection (o_proj), which the scorer needs")
    return projection.weight.detach()


class PrefillRecorder:
    """Collects what a scorer `Needs` from every layer of an observed prefill, per sequence.

    Args:
        needs: what to record.
        real: `[rows, n]` bool, the real (non-padding) tokens of every sequence.
    """

    def __init__(self, needs: Needs, real: torch.Tensor, gates: Mapping[str, RetentionGates] | None = None) -> None:
        self.needs = needs
        self.gates = gates or {}
        self.accumulate = needs.accumulated
        self.real = real
        self.padded = not bool(real.all())
        self.query_weight = real.float() if self.padded else None
        self.counts = real.sum(dim=1)
        window = min(needs.window, int(self.counts.min()))
        # cache positions of each row's last `window` real tokens, and their token positions
        self.window_index = torch.stack([row.nonzero().flatten()[-window:] for row in real]) if window else None
        self.layers: dict[int, list[Statistics]] = {}

    def record(
        self,
        layer_idx: int,
        module: torch.nn.Module,
        query: torch.Tensor,
        scaling: float,
        received: torch.Tensor | None,
    ) -> None:
        if layer_idx in self.layers:
            raise RuntimeError(f"layer {layer_idx} was observed twice in one prefill")
        weight = output_projection(module) if self.needs.output_projection else None
        rows = []
        for row in range(query.shape[0]):
            window_queries = window_positions = None
            if self.window_index is not None:
                window_queries = query[row][:, self.window_index[row]].float()
                window_positions = torch.arange(int(self.counts[row]), device=query.device)[-window_queries.shape[1] :]
            row_received = None
            if received is not None:
                row_received = received[row][:, self.real[row]] if self.padded else received[row]
            rows.append(
                Statistics(
                    scaling=scaling,
                    q_heads=query.shape[1],
                    window_queries=window_queries,
                    window_positions=window_positions,
                    received=row_received,
                    output_weight=weight,
                    gates=self.gates,
                )
            )
        self.layers[layer_idx] = rows


@dataclass
class Prefill:
    """A full-cache prefill and its observations: one serves every (policy, rate) pair.

    Attributes:
        cache: the full cache (every token of every sequence, padding included).
        observations: `[row][j]` the observation of each sequence's real tokens in the `j`-th full-attention
            layer (`cache.full_layers[j]`; sliding-window layers are not observed).
        entries: per row, the stored index of each observed entry (None: the identity).
        last_logits: `[rows, vocab]` logits of each sequence's last real token.
    """

    cache: SievedCache
    observations: list[list[Observation]]
    entries: list[torch.Tensor | None]
    last_logits: torch.Tensor

    def stored(self, row: int, keep: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Keep indices over a row's observed entries, as indices of its stored entries."""
        entries = self.entries[row]
        if entries is None:
            return [list(layer) for layer in keep]
        return [[entries[index] for index in layer] for layer in keep]


def check_input_ids(model: torch.nn.Module, input_ids: torch.Tensor, what: str = "input_ids") -> None:
    """A clear error for ids that are not a `[batch, tokens]` LongTensor of the model's vocabulary."""
    if not isinstance(model, PreTrainedModel):
        raise UnhookableModelError(f"{type(model).__name__} is not a transformers PreTrainedModel")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long or input_ids.ndim != 2:
        raise ValueError(f"{what} must be a LongTensor of shape [batch, tokens]")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"{what} is empty (shape {tuple(input_ids.shape)})")
    vocab = model.get_input_embeddings().num_embeddings
    bad = input_ids[(input_ids < 0) | (input_ids >= vocab)]
    if bad.numel():
        outside = bad.unique()[:8].tolist()
        raise ValueError(f"{what} holds token ids outside the model's vocabulary of {vocab}: {outside}")


def real_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """`[rows, n]` bool: the real tokens (1 in `attention_mask`), with a clear error for a bad mask."""
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.bool)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {shape}")
    real = attention_mask.to(device=input_ids.device).bool()
    empty = (~real.any(dim=1)).nonzero().flatten()
    if empty.numel():
        raise ValueError(f"sequence(s) {empty.tolist()} of the batch have no real token (attention_mask all 0)")
    return real


def _last_logits(model: torch.nn.Module, call: Callable[..., torch.Tensor], real: torch.Tensor) -> torch.Tensor:
    """Logits `[rows, vocab]` of each row's last real token, computing the head only where needed."""
    last = torch.stack([row.nonzero().flatten()[-1] for row in real])
    columns, where = last.unique(return_inverse=True)
    logits = call(logits_to_keep=columns if columns.numel() > 1 else int(real.shape[1] - columns[0]))
    return logits[torch.arange(real.shape[0], device=logits.device), where]


@torch.no_grad()
def observe_prefill(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    needs: Needs | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
) -> Prefill:
    """Run one full-cache prefill with sieve attention and observe every layer of every sequence.

    Args:
        input_ids: `[rows, n]`; padded sequences (left or right) need `attention_mask`.
        needs: what to record besides the entries (default: the last `DEFAULT_WINDOW` queries).
        attention_mask: `[rows, n]`, 1 for real tokens and 0 for padding.
    """
    needs = Needs(window=DEFAULT_WINDOW) if needs is None else needs
    if needs.window < 0:
        raise ValueError(f"the observation window must be >= 0, got {needs.window}")
    check_input_ids(model, input_ids)
    real = real_tokens(input_ids, attention_mask)
    recorder = PrefillRecorder(needs, real, needed_gates(model, needs))
    cache = SievedCache.for_model(model)
    cache.recorder = recorder
    inputs = {"input_ids": input_ids, "past_key_values": cache, "use_cache": True}
    if recorder.padded:
        inputs |= {"attention_mask": real.long(), "position_ids": (real.long().cumsum(-1) - 1).clamp(min=0)}
    try:
        with sieve_attention(model):
            last_logits = _last_logits(model, lambda **extra: model(**inputs, **extra).logits, real)
    finally:
        cache.recorder = None
    num_layers, full = len(cache.layers), cache.full_layers
    if num_layers == 0 or sorted(recorder.layers) != full:
        raise UnhookableModelError(
            f"{type(model).__name__}: sieve attention saw {len(recorder.layers)} of {len(full)} full-attention "
            "layers; its attention does not go through the transformers attention interface"
        )
    rotary = find_rotary(model) if needs.rotary and full else None
    entries = [row.nonzero().flatten() if recorder.padded else None for row in real]
    observations = [
        [
            _prefill_observation(cache.layers[i], row, entries[row], recorder.layers[i][row], i, num_layers, rotary)
            for i in full
        ]
        for row in range(input_ids.shape[0])
    ]
    return Prefill(cache=cache, observations=observations, entries=entries, last_logits=last_logits)


def _prefill_observation(
    layer: SievedLayer,
    row: int,
    entries: torch.Tensor | None,
    stats: Statistics,
    layer_idx: int,
    num_layers: int,
    rotary: Rotary | None,
) -> Observation:
    """The observation of one row's real tokens in a freshly prefilled (strided, unevicted) layer."""
    view = layer.segments.padded()
    keys, values = view.keys[row], view.values[row]
    if entries is not None:
        keys, values = keys[:, entries], values[:, entries]
    positions = torch.arange(keys.shape[1], device=keys.device).expand(keys.shape[0], -1)
    return Observation(layer_idx, num_layers, keys, values, positions, None, stats, rotary)


def layer_statistics(model: torch.nn.Module, needs: Needs = Needs()) -> list[Statistics]:
    """Per layer (sliding-window ones included), what every observation states (softmax scale, query heads)
    and the output projection and retention gates if needed."""
    gates = needed_gates(model, needs)
    return [
        Statistics(
            scaling=layer.self_attn.scaling,
            q_heads=layer.self_attn.config.num_attention_heads,
            output_weight=output_projection(layer.self_attn) if needs.output_projection else None,
            gates=gates,
        )
        for layer in model.base_model.layers
    ]


def cached_observations(
    cache: SievedCache, layers: Sequence[Statistics], row: int = 0, rotary: Rotary | None = None
) -> list[Observation]:
    """Observations of the entries a (possibly evicted) cache holds for one sequence, one per full-attention layer.

    Every kv-head has its own entries, padded to the longest and marked by `valid`; `layers` gives
    every layer's `Statistics` (`layer_statistics`, recent queries added by the caller). The attention
    each entry received is read from the cache when it keeps it (a bounded cache whose scorer
    accumulates). Nothing is recomputed: a scorer that reads what is neither given nor kept raises a
    clear error.
    """
    if len(layers) != len(cache.layers):
        raise ValueError(f"got statistics of {len(layers)} layers for a cache of {len(cache.layers)}")
    observations = []
    for idx in cache.full_layers:
        layer, stats = cache.layers[idx], layers[idx]
        segments = layer.segments
        view = segments.padded()
        positions = view.slots.positions()[row]
        valid = positions != PAD_POSITION
        positions = positions.masked_fill(~valid, -1)
        if segments.received is not None:  # [heads, n, group] -> [q_heads, n]
            received = segments.padded_received()[row].permute(0, 2, 1).flatten(0, 1)
            stats = dataclasses.replace(stats, received=received)
        observations.append(
            Observation(
                idx,
                len(cache.layers),
                view.keys[row],
                view.values[row],
                positions,
                valid,
                stats,
                rotary,
                seen=layer.seen_tokens,
            )
        )
    return observations


def observe_cache(model: torch.nn.Module, cache: SievedCache, row: int = 0) -> list[Observation]:
    """`cached_observations` of one sequence of `cache`, with the layer statistics read from `model`."""
    return cached_observations(cache, layer_statistics(model), row)
