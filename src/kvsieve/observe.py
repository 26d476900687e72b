"""Observations: what a scorer may look at for one layer, and the observed prefill that makes them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import UnhookableModelError, enable_sieve_attention
from .cache import SievedCache, SievedLayer

#: Queries at the end of the context whose attention is recorded separately.
DEFAULT_WINDOW = 32


@dataclass
class AttentionRecorder:
    """Collects, per layer, the attention each stored key received during an observed prefill."""

    window: int = DEFAULT_WINDOW
    stats: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def __call__(self, layer_idx: int, stats: dict[str, torch.Tensor]) -> None:
        if layer_idx in self.stats:
            raise RuntimeError(f"layer {layer_idx} was observed twice in one prefill")
        self.stats[layer_idx] = stats


@dataclass
class Observation:
    """What a scorer may look at for one layer, right after the prefill.

    Attributes:
        layer_idx, num_layers: where the layer sits in the model.
        positions: `[n]` original positions of the entries (identical for every kv-head).
        received: `[q_heads, n]` attention each key received, summed over all prefill queries.
        received_window: `[q_heads, n]` the same, from the last `window` queries only.
        queries_seeing: `[n]` how many prefill queries could attend to each key (causality).
        window: size of the last-query window.
    """

    layer_idx: int
    num_layers: int
    positions: torch.Tensor
    received: torch.Tensor
    received_window: torch.Tensor
    queries_seeing: torch.Tensor
    window: int
    layer: SievedLayer

    @property
    def num_kv_heads(self) -> int:
        return len(self.layer.head_keys)

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

    def per_kv_head(self, per_query_head: torch.Tensor) -> torch.Tensor:
        """Sum a `[q_heads, n]` statistic over the query heads that share each kv-head."""
        q_heads, n = per_query_head.shape
        return per_query_head.view(self.num_kv_heads, q_heads // self.num_kv_heads, n).sum(dim=1)


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


@torch.no_grad()
def observe_prefill(model: torch.nn.Module, input_ids: torch.Tensor, window: int = DEFAULT_WINDOW) -> Prefill:
    """Run one full-cache prefill with sieve attention and collect an `Observation` per layer."""
    _check_input_ids(input_ids)
    enable_sieve_attention(model)
    recorder = AttentionRecorder(window=window)
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
    observations = []
    for layer_idx, layer in enumerate(cache.layers):
        positions = layer.head_positions[0]
        query_positions = positions  # every prefill token is a query
        seeing = query_positions.numel() - torch.searchsorted(query_positions, positions)
        stats = recorder.stats[layer_idx]
        observations.append(
            Observation(
                layer_idx=layer_idx,
                num_layers=num_layers,
                positions=positions,
                received=stats["received"],
                received_window=stats["received_window"],
                queries_seeing=seeing,
                window=window,
                layer=layer,
            )
        )
    return Prefill(cache=cache, observations=observations, last_logits=out.logits[:, -1])
