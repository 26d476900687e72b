"""Observations: what a scorer may look at for one layer, and the observed prefill that makes them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .attention import UnhookableModelError, enable_sieve_attention
from .cache import LayerStatistics, SievedCache, SievedLayer

#: Queries at the end of the context that every observed prefill records.
DEFAULT_WINDOW = 32

#: `positions [n] -> (cos, sin)`, each `[n, head_dim]`: the model's rotary embedding.
Rotary = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class AttentionRecorder:
    """Collects the `LayerStatistics` of every layer during an observed prefill."""

    window: int = DEFAULT_WINDOW
    accumulate: bool = True
    stats: dict[int, LayerStatistics] = field(default_factory=dict)

    def __call__(self, layer_idx: int, stats: LayerStatistics) -> None:
        if layer_idx in self.stats:
            raise RuntimeError(f"layer {layer_idx} was observed twice in one prefill")
        self.stats[layer_idx] = stats


def causal_attention(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Softmax attention probabilities `[heads, q, n]` of `queries [heads, q, d]` over `keys [heads, n, d]`.

    A query sees the keys at or before its own position.
    """
    scores = (queries.float() @ keys.float().transpose(-1, -2)) * scaling
    scores = scores.masked_fill(key_positions[None, None, :] > query_positions[None, :, None], float("-inf"))
    return torch.softmax(scores, dim=-1)


@dataclass
class Observation:
    """What a scorer may look at for one layer, right after the prefill (nothing evicted yet).

    Attributes:
        layer_idx, num_layers: where the layer sits in the model.
        positions: `[n]` original positions of the entries (identical for every kv-head).
        received: `[q_heads, n]` attention each key received, summed over all prefill queries;
            None when the prefill was observed with `accumulate=False`.
        queries_seeing: `[n]` how many prefill queries could attend to each key (causality).
        window_queries: `[q_heads, w, head_dim]` the last `w` queries of the prefill, after RoPE.
        window_positions: `[w]` their positions.
        scaling: the layer's softmax scale.
        layer: the full-cache layer (keys after RoPE, values, per kv-head).
        output_weight: the layer's output projection `[hidden, q_heads * head_dim]`, if any.
        rotary: the model's rotary embedding, if any.
    """

    layer_idx: int
    num_layers: int
    positions: torch.Tensor
    received: torch.Tensor | None
    queries_seeing: torch.Tensor
    window_queries: torch.Tensor
    window_positions: torch.Tensor
    scaling: float
    layer: SievedLayer
    output_weight: torch.Tensor | None = None
    rotary: Rotary | None = None

    @property
    def window(self) -> int:
        """How many of the last queries were recorded."""
        return int(self.window_queries.shape[1])

    @property
    def num_kv_heads(self) -> int:
        return len(self.layer.head_keys)

    @property
    def group(self) -> int:
        """Query heads per kv-head."""
        return self.window_queries.shape[0] // self.num_kv_heads

    @property
    def length(self) -> int:
        return int(self.positions.numel())

    @property
    def keys(self) -> torch.Tensor:
        """`[kv_heads, n, head_dim]` keys after RoPE (a fresh stacked copy)."""
        return torch.stack([k[0] for k in self.layer.head_keys])

    @property
    def values(self) -> torch.Tensor:
        """`[kv_heads, n, head_dim]` values (a fresh stacked copy)."""
        return torch.stack([v[0] for v in self.layer.head_values])

    def require_received(self, who: str) -> torch.Tensor:
        """`received`, or a clear error when the prefill did not accumulate it."""
        if self.received is None:
            raise ValueError(f"{who} needs the attention accumulated over all queries: observe with accumulate=True")
        return self.received

    def queries(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last `window` recorded queries `[q_heads, w, d]` and their positions."""
        if window > self.window:
            raise ValueError(f"window={window} needs a prefill observed with window >= {window}, got {self.window}")
        return self.window_queries[:, -window:], self.window_positions[-window:]

    def window_attention(self, window: int) -> torch.Tensor:
        """`[q_heads, w, n]` attention probabilities of the last `window` queries (exact, recomputed)."""
        queries, query_positions = self.queries(window)
        keys = self.keys.repeat_interleave(self.group, dim=0)
        return causal_attention(queries, query_positions, keys, self.positions, self.scaling)

    def per_kv_head(self, per_query_head: torch.Tensor) -> torch.Tensor:
        """Sum a `[q_heads, ...]` statistic over the query heads that share each kv-head."""
        return per_query_head.unflatten(0, (self.num_kv_heads, -1)).sum(dim=1)


@dataclass
class Prefill:
    """A full-cache prefill and its observations: one serves every (policy, rate) pair."""

    cache: SievedCache
    observations: list[Observation]
    last_logits: torch.Tensor


def _check_input_ids(input_ids: torch.Tensor) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long or input_ids.ndim != 2:
        raise ValueError("input_ids must be a LongTensor of shape [1, tokens]")
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"batch size {input_ids.shape[0]} is not supported: kvsieve compresses one sequence at a time "
            "(each sequence keeps its own entries)"
        )
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty")


def find_rotary(model: torch.nn.Module) -> Rotary | None:
    """The model's rotary embedding as `positions -> (cos, sin)`, or None if it has none."""
    module = getattr(getattr(model, "base_model", model), "rotary_emb", None)
    if module is None:
        return None

    def rotary(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.zeros(1, dtype=torch.float32, device=positions.device)
        cos, sin = module(probe, positions[None])
        return cos[0].float(), sin[0].float()

    return rotary


@torch.no_grad()
def observe_prefill(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    window: int = DEFAULT_WINDOW,
    accumulate: bool = True,
) -> Prefill:
    """Run one full-cache prefill with sieve attention and collect an `Observation` per layer.

    Args:
        window: how many of the last queries to record.
        accumulate: also sum the attention every key receives from all queries (needed by
            `importance`, `h2o`, `vatp`; costs a materialised softmax instead of fused SDPA).
    """
    _check_input_ids(input_ids)
    if window < 1:
        raise ValueError(f"the observation window must be >= 1, got {window}")
    enable_sieve_attention(model)
    recorder = AttentionRecorder(window=window, accumulate=accumulate)
    cache = SievedCache()
    cache.recorder = recorder
    try:
        out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    finally:
        cache.recorder = None
    num_layers = len(cache.layers)
    if num_layers == 0 or sorted(recorder.stats) != list(range(num_layers)):
        raise UnhookableModelError(
            f"{type(model).__name__}: sieve attention saw {len(recorder.stats)} of {num_layers} cached layers; "
            "its attention does not go through the transformers attention interface"
        )
    rotary = find_rotary(model)
    observations = []
    for layer_idx, layer in enumerate(cache.layers):
        positions = layer.head_positions[0]
        seeing = positions.numel() - torch.searchsorted(positions, positions)  # every prefill token is a query
        stats = recorder.stats[layer_idx]
        observations.append(
            Observation(
                layer_idx=layer_idx,
                num_layers=num_layers,
                positions=positions,
                received=stats.received,
                queries_seeing=seeing,
                window_queries=stats.window_queries,
                window_positions=stats.window_positions,
                scaling=stats.scaling,
                layer=layer,
                output_weight=stats.output_weight,
                rotary=rotary,
            )
        )
    return Prefill(cache=cache, observations=observations, last_logits=out.logits[:, -1])
