"""SievedCache: a `transformers.Cache` whose entries are stored per (layer, kv-head).

Every kv-head of every layer holds its own key/value tensors, so heads may keep different
numbers of entries and evicted entries are really freed. Each stored entry remembers its
original position; the logical length (tokens seen) is kept apart from the stored length so
new tokens are placed at their true positions by `model.generate()` and plain forwards.

The cache only works together with kvsieve's sieve attention (`kvsieve.attention`), which
`kvsieve.compress` and `kvsieve.apply` switch on: `update` returns a `LayerView` of ragged
per-head tensors, not one dense tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

#: Factor by which a head's storage grows when a decode step finds it full.
GROWTH = 1.02


@dataclass
class LayerStatistics:
    """What sieve attention reports for one layer during an observed prefill.

    Attributes:
        received: `[q_heads, n]` attention each key received, summed over all queries
            (None unless the recorder asked for it: it costs a materialised softmax).
        window_queries: `[q_heads, w, head_dim]` the last `w` queries after RoPE, float32.
        window_positions: `[w]` their positions.
        scaling: the softmax scale of the layer.
        output_weight: the layer's output projection `[hidden, q_heads * head_dim]`, if it has one.
    """

    received: torch.Tensor | None
    window_queries: torch.Tensor
    window_positions: torch.Tensor
    scaling: float
    output_weight: torch.Tensor | None


class Recorder(Protocol):
    """Receives the statistics of an observed prefill, layer by layer."""

    window: int
    accumulate: bool

    def __call__(self, layer_idx: int, stats: LayerStatistics) -> None: ...


@dataclass
class LayerView:
    """What `SievedCache.update` hands to the attention function for one layer.

    Attributes:
        keys: per kv-head keys, each `[batch, n_h, head_dim]`.
        values: per kv-head values, each `[batch, n_h, head_dim]`.
        positions: per kv-head original positions of the stored entries, each `[n_h]`.
        query_positions: positions of the tokens of the current forward, `[q]`.
        layer_idx: index of the layer in the model.
        recorder: set during an observed prefill; receives the attention statistics.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: list[torch.Tensor]
    query_positions: torch.Tensor
    layer_idx: int
    recorder: Recorder | None = None


def _resized(buffer: torch.Tensor, length: int, capacity: int, dim: int) -> torch.Tensor:
    """A new buffer of `capacity` along `dim` holding the first `length` entries of `buffer`."""
    shape = list(buffer.shape)
    shape[dim] = capacity
    out = buffer.new_empty(shape)
    out.narrow(dim, 0, length).copy_(buffer.narrow(dim, 0, length))
    return out


class SievedLayer(CacheLayerMixin):
    """One layer of a `SievedCache`: a list of (keys, values, positions) per kv-head."""

    is_sliding = False
    is_compileable = False

    def __init__(self) -> None:
        super().__init__()
        self.head_keys: list[torch.Tensor] = []
        self.head_values: list[torch.Tensor] = []
        self.head_positions: list[torch.Tensor] = []
        # per kv-head storage the views above are prefixes of: (keys, values, positions)
        self._buffers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.seen_tokens = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, n_heads = key_states.shape[:2]
        self.dtype, self.device = key_states.dtype, key_states.device
        self._set_heads(
            [
                (
                    key_states.new_empty(batch, 0, key_states.shape[-1]),
                    value_states.new_empty(batch, 0, value_states.shape[-1]),
                    torch.empty(0, dtype=torch.long, device=self.device),
                )
                for _ in range(n_heads)
            ]
        )
        self.is_initialized = True

    def _set_heads(self, buffers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """Use exactly-sized tensors as the storage of every head."""
        self._buffers = buffers
        self.head_keys = [k for k, _, _ in buffers]
        self.head_values = [v for _, v, _ in buffers]
        self.head_positions = [p for _, _, p in buffers]

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("SievedLayer is updated through SievedCache.update")

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor, positions: torch.Tensor) -> None:
        """Append `[batch, kv_heads, q, head_dim]` states at the given original positions.

        Each head writes into its own storage, which grows by `GROWTH` when full, so decoding
        does not copy the whole cache every step and the slack stays within 2%.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[1] != len(self.head_keys):
            raise ValueError(
                f"expected {len(self.head_keys)} kv-heads, got key states of shape {tuple(key_states.shape)}"
            )
        n_new = key_states.shape[2]
        for h, (keys, values, stored_positions) in enumerate(self._buffers):
            n = self.head_keys[h].shape[1]
            if n + n_new > keys.shape[1]:
                capacity = n + n_new if n == 0 else max(n + n_new, math.ceil((n + n_new) * GROWTH))
                keys, values, stored_positions = (
                    _resized(keys, n, capacity, dim=1),
                    _resized(values, n, capacity, dim=1),
                    _resized(stored_positions, n, capacity, dim=0),
                )
                self._buffers[h] = (keys, values, stored_positions)
            keys[:, n : n + n_new] = key_states[:, h]
            values[:, n : n + n_new] = value_states[:, h]
            stored_positions[n : n + n_new] = positions
            self.head_keys[h] = keys[:, : n + n_new]
            self.head_values[h] = values[:, : n + n_new]
            self.head_positions[h] = stored_positions[: n + n_new]
        self.seen_tokens = max(self.seen_tokens, int(positions[-1]) + 1)

    def keep(self, keep_indices: Sequence[torch.Tensor]) -> SievedLayer:
        """A new layer holding only the stored entries at `keep_indices` (one index tensor per kv-head).

        Indices are sorted first, so stored positions stay in increasing order (sieve attention relies on it).
        """
        if len(keep_indices) != len(self.head_keys):
            raise ValueError(f"need one index tensor per kv-head ({len(self.head_keys)}), got {len(keep_indices)}")
        out = SievedLayer()
        out.dtype, out.device, out.is_initialized = self.dtype, self.device, True
        out.seen_tokens = self.seen_tokens
        buffers = []
        for h, idx in enumerate(keep_indices):
            idx = idx.to(device=self.device, dtype=torch.long).sort().values
            if idx.numel() > 1 and bool((idx[1:] == idx[:-1]).any()):
                raise ValueError(f"keep indices for kv-head {h} contain duplicates")
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.head_keys[h].shape[1]):
                raise IndexError(f"keep index out of range for kv-head {h} ({self.head_keys[h].shape[1]} stored)")
            buffers.append(
                (
                    self.head_keys[h].index_select(1, idx),
                    self.head_values[h].index_select(1, idx),
                    self.head_positions[h].index_select(0, idx),
                )
            )
        out._set_heads(buffers)
        return out

    def stored_lengths(self) -> list[int]:
        return [int(k.shape[1]) for k in self.head_keys]

    def nbytes(self) -> int:
        """Bytes of the stored keys and values."""
        return sum(t.numel() * t.element_size() for t in (*self.head_keys, *self.head_values))

    def allocated_nbytes(self) -> int:
        """Bytes allocated for keys and values, growth slack included (at most `GROWTH - 1` over `nbytes`)."""
        return sum(t.untyped_storage().nbytes() for k, v, _ in self._buffers for t in (k, v))

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        # The mask built by transformers is in logical positions; sieve attention masks by the
        # stored original positions itself.
        return self.seen_tokens + cache_position.shape[0], 0

    def get_max_cache_shape(self) -> int:
        return -1

    def _unsupported(self, what: str) -> None:
        raise NotImplementedError(
            f"SievedCache does not support {what}: use batch size 1, greedy or sampled decoding "
            "with num_return_sequences=1, and no assisted decoding"
        )

    def reset(self) -> None:
        self.__init__()

    def crop(self, max_length: int) -> None:
        self._unsupported("cropping (assisted decoding)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._unsupported("beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            self._unsupported("expanding the batch (num_return_sequences > 1 or beams)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._unsupported("selecting batch rows")

    def offload(self) -> None:
        self._unsupported("offloading")

    def prefetch(self) -> None:
        self._unsupported("offloading")


class SievedCache(Cache):
    """A KV cache stored per (layer, kv-head) that eviction physically shrinks.

    Use it like any `transformers` cache once sieve attention is on (`kvsieve.compress`
    does both)::

        cache = kvsieve.compress(model, ids, policy="importance", rate=0.8)
        model.generate(torch.cat([ids, next_ids], -1), past_key_values=cache)

    As for every pre-filled cache in `transformers`, `generate` takes the full sequence
    (context + new tokens) and feeds only the tokens the cache has not seen.
    """

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=SievedLayer)
        self.recorder: Recorder | None = None

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[LayerView, LayerView]:
        """Append the new states and return a `LayerView` (as both keys and values) for sieve attention."""
        while len(self.layers) <= layer_idx:
            self.layers.append(SievedLayer())
        layer: SievedLayer = self.layers[layer_idx]
        if key_states.shape[0] != 1:
            raise ValueError(
                f"SievedCache supports batch size 1 only (got {key_states.shape[0]}): "
                "each sequence keeps its own entries"
            )
        n_new = key_states.shape[-2]
        cache_position = (cache_kwargs or {}).get("cache_position")
        if cache_position is None:
            positions = torch.arange(layer.seen_tokens, layer.seen_tokens + n_new, device=key_states.device)
        else:
            positions = cache_position.to(device=key_states.device, dtype=torch.long)
        layer.append(key_states, value_states, positions)
        view = LayerView(
            keys=layer.head_keys,
            values=layer.head_values,
            positions=layer.head_positions,
            query_positions=positions,
            layer_idx=layer_idx,
            recorder=self.recorder,
        )
        return view, view

    def kept_positions(self, layer_idx: int) -> list[torch.Tensor]:
        """Original positions of the entries stored in `layer_idx`, one LongTensor per kv-head."""
        return [p.clone() for p in self.layers[layer_idx].head_positions]

    def stored_lengths(self) -> list[list[int]]:
        """Stored entries per (layer, kv-head)."""
        return [layer.stored_lengths() for layer in self.layers]

    def nbytes(self) -> int:
        """Bytes held by the stored keys and values (positions bookkeeping not included)."""
        return sum(layer.nbytes() for layer in self.layers)

    def allocated_nbytes(self) -> int:
        """Bytes allocated for keys and values: `nbytes()` plus at most 2% growth slack after decoding."""
        return sum(layer.allocated_nbytes() for layer in self.layers)

    def keep(self, keep_indices: Sequence[Sequence[torch.Tensor]]) -> SievedCache:
        """A new cache with only the given stored entries: `keep_indices[layer][head]` index the stored entries.

        The original cache is left as it is, so one prefill can serve many eviction configurations.
        """
        if len(keep_indices) != len(self.layers):
            raise ValueError(f"need keep indices for {len(self.layers)} layers, got {len(keep_indices)}")
        out = SievedCache()
        out.layers = [layer.keep(idx) for layer, idx in zip(self.layers, keep_indices, strict=True)]
        return out

    def evict(self, keep_indices: Sequence[Sequence[torch.Tensor]]) -> None:
        """Keep only the given stored entries, in place; the dropped tensors are released."""
        self.layers = self.keep(keep_indices).layers

    def copy(self) -> SievedCache:
        """A deep copy (every entry kept)."""
        return self.keep(
            [[torch.arange(n, device=layer.device) for n in layer.stored_lengths()] for layer in self.layers]
        )
