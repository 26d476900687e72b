"""SievedCache: a `transformers.Cache` whose entries are stored per (sequence, layer, kv-head).

Every kv-head of every full-attention layer of every sequence keeps its own entries
(`kvsieve.runtime.storage.segments`), so heads, layers and sequences may keep different numbers of entries and
evicted entries are really freed. Sliding-window layers keep `transformers`' own rolling window
(`kvsieve.runtime.storage.sliding.SlidingLayer`): no policy evicts them, they are copied and counted as they are.
Each entry remembers its cache position; the logical length (tokens seen) is kept apart from the
stored length, so `model.generate()` and plain forwards place new tokens at their true positions.

The layers follow the `transformers` cache contract: `update` appends and returns `[batch,
kv_heads, length, head_dim]` key and value tensors, `get_mask_sizes` describes the logical
sequence the attention mask covers. Until something is evicted the tensors are the plain cache
and any attention function reads them. Once heads hold different entries, only sieve attention
(`kvsieve.sieve_attention`) reads them correctly; another attention function fails with an error
that says so instead of computing a wrong answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ...modeling.architecture import layer_windows
from ...selection.merge import Merged
from ..compat import query_length
from .codecs import FULL_PRECISION, EntryCodec
from .layout import AttentionTally, QueryLog, RaggedLayout, Recorder, active_scope
from .merged import MergedEntries
from .quantized_segments import Store, kept_store, store_from_dense
from .segments import Slots
from .sliding import SlidingLayer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: `keep[row][layer][kv_head]`: indices of the stored entries to keep, per full-attention layer (in order).
KeepIndices = Sequence[Sequence[Sequence[torch.Tensor]]]


class Growth(Protocol):
    """Bounds a cache while it grows (see `kvsieve.runtime.eviction.growth.BoundedGrowth`).

    `queries` logs the recent queries its scorer reads; `accumulates` says whether its scorer reads
    the attention every entry received, which the cache then sums online.
    """

    queries: QueryLog | None
    accumulates: bool

    def before_append(self, cache: SievedCache, incoming: int) -> None:
        """Called before a forward appends `incoming` tokens to every layer; may evict."""
        ...


class RaggedAttentionError(RuntimeError):
    """An evicted `SievedCache` was used outside sieve attention, which alone reads it correctly."""


class SievedLayer(CacheLayerMixin):
    """One layer of a `SievedCache`: the entries of every (row, kv-head) and the number of tokens seen.

    `codec` says how entries are stored (`kvsieve.runtime.storage.codecs`: full precision, or quantized).
    `merged`: what each (row, kv-head) evicted, folded into one entry (`kvsieve.selection.merge`), or None.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, codec: EntryCodec = FULL_PRECISION) -> None:
        super().__init__()
        self.codec = codec
        self.segments: Store | None = None
        self.seen_tokens = 0
        self.contiguous = True
        self.slots: Slots | None = None  # of the tensors the last `update` returned
        self.query_positions: torch.Tensor | None = None
        self.merged: MergedEntries | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device, self.head_dim = key_states.dtype, key_states.device, key_states.shape[-1]
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `[batch, kv_heads, q, head_dim]` states; return every stored entry, padded per (row, kv-head).

        The new entries take the cache positions after every token seen (what `transformers` passed as
        `cache_position` up to 5.4, and computes the same way since)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        positions = torch.arange(self.seen_tokens, self.seen_tokens + q, device=key_states.device)
        if self.segments is None:
            self.segments, view = store_from_dense(key_states, value_states, positions, self.codec)
        else:
            if key_states.shape[:2] != (self.segments.rows, self.segments.heads):
                raise ValueError(
                    f"the cache holds {self.segments.rows} sequence(s) x {self.segments.heads} kv-heads, got states "
                    f"for {key_states.shape[0]} x {key_states.shape[1]}; a pre-filled cache is not expanded for "
                    "beams or num_return_sequences: pass `cache.copy(rows=[0] * n)` for n rows"
                )
            view = self.segments.append(key_states, value_states, positions)
        self.seen_tokens += q  # tokens fed, as `DynamicLayer` counts them (no device sync)
        self.slots, self.query_positions = view.slots, positions
        return view.keys, view.values

    def layout(
        self,
        layer_idx: int,
        recorder: Recorder | None = None,
        queries: QueryLog | None = None,
        tally: AttentionTally | None = None,
    ) -> RaggedLayout:
        """What sieve attention must know about the tensors the last `update` returned (`storage.layout`)."""
        return RaggedLayout(
            self.slots, self.query_positions, self.contiguous, layer_idx, recorder, queries, tally, self.merged
        )

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query: torch.Tensor | int) -> tuple[int, int]:
        """The mask covers the logical sequence: every token seen plus the new ones, from position 0."""
        return self.seen_tokens + query_length(query), 0

    def get_max_length(self) -> int:
        """No maximum: the layer grows until a policy evicts (`-1`, as `DynamicLayer`)."""
        return -1

    get_max_cache_shape = get_max_length  # its name up to transformers 5.13

    @property
    def batch_size(self) -> int:
        return 0 if self.segments is None else self.segments.rows

    def stored_lengths(self, row: int = 0) -> list[int]:
        """Entries stored per kv-head of `row`."""
        if self.segments is None:
            return []
        heads = self.segments.heads
        return self.segments.lengths[row * heads : (row + 1) * heads]

    def kept_positions(self, row: int = 0) -> list[torch.Tensor]:
        """Cache positions of the entries stored per kv-head of `row` (copies)."""
        if self.segments is None:
            return []
        return [self.segments.segment(row, h)[2].clone() for h in range(self.segments.heads)]

    def nbytes(self) -> int:
        merged = 0 if self.merged is None else self.merged.nbytes()
        return merged + (0 if self.segments is None else self.segments.nbytes())

    def row_nbytes(self, row: int) -> int:
        """Bytes one sequence's entries (merged ones included) take in this layer."""
        merged = 0 if self.merged is None else self.merged.row_nbytes(row)
        return merged + (0 if self.segments is None else self.segments.row_nbytes(row))

    def reserved_nbytes(self) -> int:
        """Bytes per sequence a byte budget sets aside for this layer: its residual's extra over quantized entries."""
        if self.segments is None:
            return 0
        return self.segments.heads * self.codec.residual_bytes(self.head_dim, self.dtype)

    def allocated_nbytes(self) -> int:
        merged = 0 if self.merged is None else self.merged.allocated_nbytes()
        return merged + (0 if self.segments is None else self.segments.allocated_nbytes())

    def entry_bytes(self) -> int:
        """Bytes of one stored entry's key and value."""
        return 0 if self.segments is None else self.segments.entry_bytes()

    def keep(
        self, keep: Sequence[Sequence[torch.Tensor]], rows: Sequence[int], codec: EntryCodec | None = None
    ) -> SievedLayer:
        """A new layer whose row `i` holds the entries `keep[i][h]` of kv-head `h` of row `rows[i]`, stored by
        `codec` (default: as this layer stores them)."""
        if self.segments is None:
            raise ValueError("the cache layer is empty: prefill it before evicting")
        heads = self.segments.heads
        sources, indices = [], []
        kept_all = True
        for r, (row, per_head) in enumerate(zip(rows, keep, strict=True)):
            if not 0 <= row < self.segments.rows:
                raise IndexError(f"row {row} is out of range for a cache of {self.segments.rows} sequence(s)")
            if len(per_head) != heads:
                raise ValueError(f"need one index tensor per kv-head ({heads}) for output row {r}, got {len(per_head)}")
            for h, index in enumerate(per_head):
                stored = self.segments.lengths[row * heads + h]
                index = _checked_index(index, stored, f"row {r}, kv-head {h}")
                kept_all &= index.numel() == stored
                sources.append(row * heads + h)
                indices.append(index)
        out = SievedLayer(codec or self.codec)
        out.dtype, out.device, out.head_dim, out.is_initialized = self.dtype, self.device, self.head_dim, True
        out.seen_tokens = self.seen_tokens
        out.contiguous = self.contiguous and kept_all
        out.segments = kept_store(self.segments, sources, indices, len(rows), out.codec)
        out.merged = None if self.merged is None else self.merged.rows(rows)
        return out

    def merge(self, per_row: Sequence[Merged | None]) -> None:
        """Hold each row's merged entries (`Policy.merged`; None: a row that merges nothing) beside its segments."""
        if self.segments is None or len(per_row) != self.segments.rows:
            raise ValueError(f"need merged entries for each of the {self.batch_size} rows, got {len(per_row)}")
        if self.merged is not None:
            raise ValueError("the layer already holds merged entries: a merge summarizes one eviction of a prompt")
        self.merged = MergedEntries.stacked(per_row, self.segments.heads, self.head_dim, self.dtype, self.device)
        self.contiguous = self.contiguous and self.merged is None

    def crop(self, max_length: int) -> None:
        """Forget every entry at cache position `max_length` or later (assisted decoding rolls back this way)."""
        if self.segments is None or max_length >= self.seen_tokens:
            return
        if max_length < 0:
            max_length = self.seen_tokens + max_length
        heads = self.segments.heads
        keep = [
            [(self.segments.segment(row, h)[2] < max_length).nonzero().flatten() for h in range(heads)]
            for row in range(self.segments.rows)
        ]
        cropped = self.keep(keep, range(self.segments.rows))
        self.segments, self.seen_tokens = cropped.segments, max_length

    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep whole rows, in the given order (repeats allowed): beam search and batch expansion."""
        if self.segments is None:
            return
        heads = self.segments.heads
        everything = [
            [torch.arange(self.segments.lengths[row * heads + h], device=self.device) for h in range(heads)]
            for row in rows
        ]
        self.segments = self.keep(everything, rows).segments

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.select_rows([row for row in range(self.batch_size) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(indices.tolist())

    def reset(self) -> None:
        self.__init__(self.codec)

    def offload(self) -> None:
        raise NotImplementedError("SievedCache does not offload layers")

    def prefetch(self) -> None:
        raise NotImplementedError("SievedCache does not offload layers")


def _checked_index(index: torch.Tensor, stored: int, where: str) -> torch.Tensor:
    """`index` as sorted, distinct, in-range stored-entry indices, or a clear error."""
    index = torch.as_tensor(index).to(dtype=torch.long).flatten().sort().values
    if index.numel() > 1 and bool((index[1:] == index[:-1]).any()):
        raise ValueError(f"keep indices for {where} contain duplicates")
    if index.numel() and (int(index[0]) < 0 or int(index[-1]) >= stored):
        raise IndexError(f"keep index out of range for {where} ({stored} stored)")
    return index


class SievedCache(Cache):
    """A KV cache stored per (sequence, layer, kv-head) that eviction physically shrinks.

    Decode from an evicted cache with sieve attention on::

        cache = kvsieve.compress(model, ids, policy="snapkv", rate=0.8)
        with kvsieve.sieve_attention(model):
            model.generate(torch.cat([ids, next_ids], -1), past_key_values=cache)

    As for every pre-filled cache in `transformers`, `generate` takes the full sequence
    (context + new tokens) and feeds only the tokens the cache has not seen.
    """

    def __init__(self, layers: Sequence[SievedLayer | SlidingLayer] | None = None) -> None:
        if layers is None:
            super().__init__(layer_class_to_replicate=SievedLayer)
        else:
            super().__init__(layers=list(layers))
            self.layer_class_to_replicate = SievedLayer
        self.recorder: Recorder | None = None
        self.growth: Growth | None = None  # set by `compress` for a size budget with a buffer

    @classmethod
    def for_model(cls, model: PreTrainedModel, codec: EntryCodec = FULL_PRECISION) -> SievedCache:
        """An empty cache with one layer per decoder layer of `model`: evictable for full attention (its entries
        stored by `codec`), the model's rolling window for sliding-window attention (as `transformers`'
        `DynamicCache(config)`; windows stay in the model's dtype)."""
        return cls([SievedLayer(codec) if window is None else SlidingLayer(window) for window in layer_windows(model)])

    @property
    def full_layers(self) -> list[int]:
        """Indices of the full-attention layers: the ones a policy scores and evicts."""
        return [idx for idx, layer in enumerate(self.layers) if not layer.is_sliding]

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: object,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append through the layer's own `update` (after `growth` had its say), then publish its layout.

        Before layer 0 appends, `growth` may evict every layer (the one place where the cache calls back
        up into selection: see docs/design.md, "Inversions of control").
        """
        if layer_idx >= len(self.layers):
            self._check_new_layer(layer_idx, key_states.shape[-2])
        scope = active_scope()
        evicted = layer_idx < len(self.layers) and not self.layers[layer_idx].contiguous
        if (evicted or self.recorder is not None or self.growth is not None) and scope is None:
            raise RaggedAttentionError(
                "this SievedCache was evicted (its kv-heads keep different entries), which only kvsieve's sieve "
                "attention reads correctly: run the model under `with kvsieve.sieve_attention(model):`"
            )
        if layer_idx == 0 and self.growth is not None:
            self.growth.before_append(self, key_states.shape[-2])
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        if scope is None or layer.is_sliding:  # sliding: plain tensors that transformers' sliding mask describes
            return keys, values
        growth = self.growth
        queries = None if growth is None else growth.queries
        tally = layer.segments if growth is not None and growth.accumulates else None
        scope.publish(keys, layer.layout(layer_idx, self.recorder, queries, tally))
        return keys, values

    def _check_new_layer(self, layer_idx: int, incoming: int) -> None:
        """A clear error when a model with more layers than the one that filled this cache feeds it.

        A cache grows its layers during its first forward; a layer asked for once the last one holds tokens
        of an earlier forward means the model has more layers than the cache was filled by."""
        if self.layers and self.layers[-1].get_seq_length() > incoming:
            raise ValueError(
                f"this SievedCache was filled by a model with {len(self.layers)} layers, but the model it is fed to "
                f"has at least {layer_idx + 1}: a cache serves the model that filled it "
                "(kvsieve.compress(model, ...) or kvsieve.SievedCache.for_model(model))"
            )

    @property
    def batch_size(self) -> int:
        return self.layers[0].batch_size if self.layers else 0

    def kept_positions(self, layer_idx: int, row: int = 0) -> list[torch.Tensor]:
        """Cache positions of the entries stored in `layer_idx` for sequence `row`, one LongTensor per kv-head."""
        return self.layers[layer_idx].kept_positions(row)

    def stored_lengths(self, row: int = 0) -> list[list[int]]:
        """Entries stored per (layer, kv-head) for sequence `row`, sliding-window layers included."""
        return [layer.stored_lengths(row) for layer in self.layers]

    def mean_stored(self, row: int = 0) -> float:
        """Entries stored per (full-attention layer, kv-head) of sequence `row`, on average: what a size budget
        bounds (sliding-window layers hold their window whatever the budget)."""
        lengths = [self.layers[idx].stored_lengths(row) for idx in self.full_layers]
        heads = sum(map(len, lengths))
        if not heads:
            raise ValueError("the cache holds no full-attention layer entries (empty, or every layer is sliding)")
        return sum(map(sum, lengths)) / heads

    def nbytes(self) -> int:
        """Bytes held by the stored keys and values of every layer (cache positions not included)."""
        return sum(layer.nbytes() for layer in self.layers)

    def row_nbytes(self, row: int) -> int:
        """Bytes held by the keys and values of one sequence, every layer."""
        return sum(layer.row_nbytes(row) for layer in self.layers)

    def window_nbytes(self) -> int:
        """Bytes one sequence's sliding-window layers hold once their windows are full."""
        return sum(layer.window_nbytes() for layer in self.layers if layer.is_sliding)

    def reserved_nbytes(self) -> int:
        """Bytes per sequence a byte budget sets aside before it counts entries: the sliding-window layers at their
        window, and the full-precision residuals of quantized layers beyond their entries' quantized bytes."""
        return self.window_nbytes() + sum(self.layers[idx].reserved_nbytes() for idx in self.full_layers)

    def allocated_nbytes(self) -> int:
        """Bytes allocated: keys and values (`nbytes()`, growth room of 2% or one block per head, null entries),
        the storage sliding-window layers' window tensors keep alive, and the attention sums of a cache whose
        scorer reads them during generation."""
        return sum(layer.allocated_nbytes() for layer in self.layers)

    def keep(
        self, keep: KeepIndices, rows: Sequence[int] | None = None, codec: EntryCodec | None = None
    ) -> SievedCache:
        """A new cache holding only the given stored entries (without `growth`); the original is left as it is.

        Args:
            keep: `keep[i][j][kv_head]` indexes the stored entries of `rows[i]` to keep in the `j`-th
                full-attention layer (`full_layers[j]`); sliding-window layers keep their window.
            rows: the source sequence of each output row (default: row `i` from row `i`); a
                sequence may appear several times, so one prefill becomes a batch of evictions.
            codec: how the kept entries are stored (`kvsieve.runtime.storage.codecs`; default: as they are).
        """
        rows = list(range(len(keep))) if rows is None else list(rows)
        return SievedCache(self._kept_layers(keep, rows, copy_windows=True, codec=codec))

    def merge(self, per_row: Sequence[Sequence[Merged] | None]) -> None:
        """Hold what each row evicted as merged entries: `per_row[i][j]` is row `i`'s in the `j`-th full-attention
        layer (`Policy.merged`), None for a row that merges nothing."""
        if len(per_row) != self.batch_size:
            raise ValueError(
                f"need merged entries (or None) for each of the {self.batch_size} rows, got {len(per_row)}"
            )
        if all(row is None for row in per_row):
            return
        for j, idx in enumerate(self.full_layers):
            self.layers[idx].merge([None if row is None else row[j] for row in per_row])

    def evict(self, keep: KeepIndices) -> None:
        """Keep only the given stored entries of every row, in place; the dropped tensors are released.
        Sliding-window layers stay as they are."""
        if len(keep) != self.batch_size:
            raise ValueError(f"evict takes keep indices for every row ({self.batch_size}), got {len(keep)}")
        self.layers = self._kept_layers(keep, list(range(len(keep))), copy_windows=False)

    def _kept_layers(
        self, keep: KeepIndices, rows: list[int], copy_windows: bool, codec: EntryCodec | None = None
    ) -> list[SievedLayer | SlidingLayer]:
        """Every layer, its full-attention ones holding only the kept entries of `rows`."""
        if len(rows) != len(keep):
            raise ValueError(f"got keep indices for {len(keep)} rows but {len(rows)} source rows")
        full = self.full_layers
        for i, per_layer in enumerate(keep):
            if len(per_layer) != len(full):
                raise ValueError(
                    f"need keep indices for {len(full)} full-attention layers in row {i}, got {len(per_layer)}"
                )
        column = {layer_idx: j for j, layer_idx in enumerate(full)}
        return [
            (layer.select(rows) if copy_windows else layer)
            if layer.is_sliding
            else layer.keep([per_layer[column[idx]] for per_layer in keep], rows, codec)
            for idx, layer in enumerate(self.layers)
        ]

    def copy(self, rows: Sequence[int] | None = None) -> SievedCache:
        """A deep copy of every entry of the given rows (default: all), e.g. `rows=[0] * n` for n copies of row 0."""
        rows = list(range(self.batch_size)) if rows is None else list(rows)
        full = [self.layers[idx] for idx in self.full_layers]
        everything = [[[torch.arange(n) for n in layer.stored_lengths(row)] for layer in full] for row in rows]
        return self.keep(everything, rows)
