"""Ragged storage of one cache layer: one segment of entries per (sequence, kv-head), packed in flat buffers.

Segment `s = row * heads + head` owns rows `[starts[s], starts[s] + lengths[s])` of the flat
buffers: the entries' keys and values as the layer's codec stores them (`kvsieve.runtime.storage.codecs`:
the tensors themselves, or quantized codes and their scales; one row per entry, `data`) and their
cache positions `[capacity]`.
A segment may have free room after its entries (`capacity[s] - lengths[s]`), handed out when
decoding outgrows it: `GROWTH` of its length, at least `BLOCK` entries, so the room stays
within 2% of the entries plus one block per head while moves stay rare. The buffers end with
one *null entry* (all zeros, which every codec reads as a zero key and value; position
`PAD_POSITION`) that padded views point at. Padded views are read back into keys and values in the
layer's dtype (for full precision, the buffers themselves).

Two layouts, chosen by the lengths: when every segment holds as many entries (and has as much
room), the buffers are a grid `[rows, heads, capacity, head_dim]` and a padded view of them is
free; otherwise the segments are packed and a padded view is gathered through `slots`, a
`[segments, width]` table of every segment's buffer rows, its room included (width = the
largest capacity; free room holds zeros), with an additive attention bias that opens a slot
when an entry is appended to it.

A scorer that reads attention accumulated online (H2O) needs one more number per entry and query
head: the attention it received so far (`received`, float32 `[capacity, group]`). It is kept only
when asked for (`add_received`), starts at 0 for every appended entry, and moves and is evicted
with its entry.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .codecs import FULL_PRECISION, EntryCodec

#: Position of the padding slots in padded views: after every real position, so causal masks hide them.
PAD_POSITION = torch.iinfo(torch.long).max

#: Free room a segment gets when appending finds it full: this fraction of its length ...
GROWTH = 0.02
#: ... and at least this many entries (one block), so short segments are not moved every step.
BLOCK = 16


@dataclass(frozen=True)
class Slots:
    """Which slots of a padded view hold entries, and at which cache positions (no key or value tensor).

    Attributes:
        bias: `[rows, heads, width]` additive attention bias, 0 where a slot holds an entry and
            -inf where it is padding; None when every slot holds one.
        source: the positions, `[rows, heads, width]` for a grid, the flat buffer otherwise.
        index: the flat buffer row of every slot (None when `source` is the grid of positions).

    The slots that hold entries come first in every row, the padding last.
    """

    bias: torch.Tensor | None
    source: torch.Tensor
    index: torch.Tensor | None

    def valid(self) -> torch.Tensor | None:
        """`[rows, heads, width]` bool: which slots hold an entry (None: all of them)."""
        return None if self.bias is None else self.bias == 0

    def positions(self) -> torch.Tensor:
        """`[rows, heads, width]` cache positions of the slots (`PAD_POSITION` for padding)."""
        if self.index is None:
            return self.source
        return self.source.index_select(0, self.index).view(self.bias.shape)


@dataclass(frozen=True)
class Entries:
    """Entries outside a `Segments`, in the model's dtype: keys `[n, d]`, values `[n, dv]`, cache positions `[n]`,
    and the attention each received (`[n, group]`, None when it is not kept)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    received: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.positions.shape[0])


@dataclass(frozen=True)
class PaddedView:
    """Every segment's entries, left-aligned and padded to the longest: keys and values
    `[rows, heads, length, head_dim]` in the layer's dtype (padding slots hold zeros) and their `Slots`."""

    keys: torch.Tensor
    values: torch.Tensor
    slots: Slots


def _exclusive_cumsum(values: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(values, 0) - values


def _buffers(
    entries: int, like: Sequence[torch.Tensor], *, zeroed: bool
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Data buffers shaped as `like`'s rows, and `PAD_POSITION` positions, for `entries` rows plus the null entry.

    The null entry is always zero; the other rows are zeroed only if `zeroed` (free room must hold
    zeros, since padded views read it); otherwise the caller writes every one of them.
    """
    data = tuple((b.new_zeros if zeroed else b.new_empty)(entries + 1, b.shape[-1]) for b in like)
    for buffer in data:
        buffer[-1] = 0
    positions = torch.full((entries + 1,), PAD_POSITION, dtype=torch.long, device=like[0].device)
    return data, positions


class Segments:
    """The entries of one layer, stored per (row, kv-head) with their cache positions.

    Attributes:
        data: the row-aligned buffers the `codec` stores keys and values in (full precision: keys, values).
        dtype: the dtype keys and values are read back in (the model's).
    """

    def __init__(
        self,
        data: tuple[torch.Tensor, ...],
        positions: torch.Tensor,
        lengths: Sequence[int],
        capacity: Sequence[int],
        rows: int,
        codec: EntryCodec = FULL_PRECISION,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.rows = rows
        self.heads = len(lengths) // rows
        self.codec = codec
        self.dtype = data[0].dtype if dtype is None else dtype
        self.received: torch.Tensor | None = None  # attention received per entry and query head (on demand)
        self._assign(data, positions, lengths, capacity)

    def _assign(
        self, data: tuple[torch.Tensor, ...], positions: torch.Tensor, lengths: Sequence[int], capacity: Sequence[int]
    ) -> None:
        self.data, self.positions = data, positions
        self.lengths, self.capacity = list(lengths), list(capacity)
        self.free = min(c - n for c, n in zip(self.capacity, self.lengths, strict=True))
        device = positions.device
        capacity_t = torch.tensor(self.capacity, dtype=torch.long, device=device)
        self.starts = _exclusive_cumsum(capacity_t)
        self.grid = len(set(self.capacity)) == 1 and len(set(self.lengths)) == 1
        if self.grid:
            shape = (self.rows, self.heads, self.capacity[0])
            self._grids = tuple(buffer[:-1].view(*shape, buffer.shape[-1]) for buffer in data)
            self._position_grid = positions[:-1].view(shape)
            return
        lengths_t = torch.tensor(self.lengths, dtype=torch.long, device=device)
        width = max(self.capacity)
        slot = torch.arange(width, device=device)
        self.slots = torch.where(slot < capacity_t[:, None], self.starts[:, None] + slot, self.null_index)
        valid = slot < lengths_t[:, None]
        self.bias = torch.zeros(valid.shape, dtype=self.dtype, device=device).masked_fill_(~valid, float("-inf"))
        # the next free buffer row and the next free flat bias slot of every segment
        self._cursor = torch.stack((self.starts, torch.arange(self.segments, device=device) * width)) + lengths_t

    @classmethod
    def unfilled(
        cls,
        lengths: Sequence[int],
        rows: int,
        like: Sequence[torch.Tensor],
        codec: EntryCodec = FULL_PRECISION,
        dtype: torch.dtype | None = None,
    ) -> Segments:
        """Exactly-sized segments (no free room) whose entries the caller writes, every one of them; data buffers
        shaped as the rows of `like`."""
        return cls(*_buffers(sum(lengths), like, zeroed=False), lengths, lengths, rows, codec, dtype)

    @classmethod
    def from_dense(
        cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, codec: EntryCodec = FULL_PRECISION
    ) -> Segments:
        """Store `[rows, heads, n, d]` states at cache positions `[n]`: every segment holds all `n` entries."""
        rows, heads, n, _ = keys.shape
        encoded = codec.encode(keys, values)
        out = cls.unfilled([n] * rows * heads, rows, encoded, codec, keys.dtype)
        for grid, states in zip(out._grids, encoded, strict=True):
            grid.copy_(states)
        out._position_grid.copy_(positions)
        return out

    @property
    def segments(self) -> int:
        return self.rows * self.heads

    @property
    def null_index(self) -> int:
        return self.positions.shape[0] - 1

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    def entry_bytes(self) -> int:
        """Bytes of one stored entry's key and value, as the codec stores them (codes and scales, if quantized)."""
        return sum(buffer.shape[-1] * buffer.element_size() for buffer in self.data)

    def nbytes(self) -> int:
        """Bytes of the stored keys and values."""
        return sum(self.lengths) * self.entry_bytes()

    def allocated_nbytes(self) -> int:
        """Bytes of the data buffers (free room and the null entry included) and of `received`."""
        tally = 0 if self.received is None else self.received.untyped_storage().nbytes()
        return sum(buffer.untyped_storage().nbytes() for buffer in self.data) + tally

    def segment(self, row: int, head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys `[n, d]`, values `[n, d]` and positions `[n]` of one segment (views, when stored in full precision)."""
        s = row * self.heads + head
        start = int(self.starts[s])
        stop = start + self.lengths[s]
        keys, values = self.codec.decode(tuple(buffer[start:stop] for buffer in self.data), self.dtype)
        return keys, values, self.positions[start:stop]

    def entries(self, segment: int, index: torch.Tensor) -> Entries:
        """Entries `index` of segment `segment` (`row * heads + head`), read back into the model's dtype."""
        rows = index.to(self.positions.device) + self.starts[segment]
        keys, values = self.codec.decode(tuple(buffer.index_select(0, rows) for buffer in self.data), self.dtype)
        received = None if self.received is None else self.received.index_select(0, rows)
        return Entries(keys, values, self.positions.index_select(0, rows), received)

    def append(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, received: torch.Tensor | None = None
    ) -> PaddedView:
        """Append `[rows, heads, q, d]` states at cache positions `[q]` to every segment (with the attention they
        received so far, `[rows, heads, q, group]`, when this layer keeps it; else they start at 0); the view
        after it."""
        q = keys.shape[2]
        if self.free < q:
            self._relayout(q)
        encoded = self.codec.encode(keys, values)
        if self.grid:
            n = self.lengths[0]
            for grid, states in zip(self._grids, encoded, strict=True):
                grid.narrow(2, n, q).copy_(states)
            self._position_grid.narrow(2, n, q).copy_(positions)
            target = None
        else:
            cursor = self._cursor[:, :, None]
            if q > 1:
                cursor = cursor + torch.arange(q, device=self.positions.device)
            target, filled = cursor.flatten(1)
            for buffer, states in zip(self.data, encoded, strict=True):
                buffer.index_copy_(0, target, states.reshape(-1, states.shape[-1]))
            self.positions.index_copy_(0, target, positions.expand(self.segments, q).flatten())
            self.bias.view(-1).index_fill_(0, filled, 0.0)
            self._cursor += q
        if received is not None and self.received is not None:
            if target is None:
                room = self.received[:-1].view(self.rows, self.heads, self.capacity[0], -1)
                room.narrow(2, self.lengths[0], q).copy_(received)
            else:
                self.received.index_copy_(0, target, received.reshape(-1, self.group).float())
        self.lengths = [n + q for n in self.lengths]
        self.free -= q
        return self.padded()

    def _relayout(self, incoming: int) -> None:
        """Move the entries into new buffers that give every segment room for `incoming` more, plus growth room."""
        capacity = [n + incoming + max(BLOCK, math.floor(GROWTH * (n + incoming))) for n in self.lengths]
        data, positions = _buffers(sum(capacity), self.data, zeroed=True)
        device = positions.device
        starts = _exclusive_cumsum(torch.tensor(capacity, dtype=torch.long, device=device))
        # every buffer row of a segment (entries, then zeroed room) moves by the same offset
        old_capacity = torch.tensor(self.capacity, dtype=torch.long, device=device)
        shift = torch.repeat_interleave(starts - self.starts, old_capacity, output_size=self.null_index)
        target = torch.arange(self.null_index, device=device) + shift
        for old, new in zip((*self.data, self.positions), (*data, positions), strict=True):
            new.index_copy_(0, target, old[:-1])
        if self.received is not None:
            received = self.received.new_zeros(positions.shape[0], self.received.shape[1])
            self.received = received.index_copy_(0, target, self.received[:-1])
        self._assign(data, positions, self.lengths, capacity)

    def padded(self) -> PaddedView:
        """Every segment padded: to its length for a grid (free), to the widest room otherwise (gathered)."""
        if self.grid:
            length = self.lengths[0]
            keys, values = self.codec.decode(tuple(grid.narrow(2, 0, length) for grid in self._grids), self.dtype)
            return PaddedView(keys, values, Slots(None, self._position_grid.narrow(2, 0, length), None))
        shape = (self.rows, self.heads, self.slots.shape[1])
        index = self.slots.view(-1)
        gathered = tuple(buffer.index_select(0, index).view(*shape, -1) for buffer in self.data)
        keys, values = self.codec.decode(gathered, self.dtype)
        return PaddedView(keys, values, Slots(self.bias.view(shape), self.positions, index))

    def select(
        self,
        sources: Sequence[int],
        indices: Sequence[torch.Tensor],
        rows: int,
        codec: EntryCodec | None = None,
        extra: Sequence[Entries] | None = None,
    ) -> Segments:
        """New exactly-sized segments: output segment `i` keeps entries `indices[i]` of segment `sources[i]`,
        then the entries `extra[i]` (held outside, in the model's dtype), stored by `codec`.

        With another `codec` the kept entries are read back and stored by it (full precision into
        quantized: compressing a prefill into fewer bits); otherwise their buffers are copied as they are.
        """
        device = self.positions.device
        pieces = [
            index.to(device=device, dtype=torch.long) + self.starts[source]
            for source, index in zip(sources, indices, strict=True)
        ]
        lengths = [int(p.numel()) for p in pieces]
        flat = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long, device=device)
        target = codec or self.codec
        kept = tuple(buffer.index_select(0, flat) for buffer in self.data)
        if target != self.codec:
            kept = target.encode(*self.codec.decode(kept, self.dtype))
        positions = self.positions.index_select(0, flat)
        received = None if self.received is None else self.received.index_select(0, flat)
        if extra is not None:
            kept, positions, received, lengths = _with_extra(target, kept, positions, received, lengths, extra)
        out = Segments.unfilled(lengths, rows, kept, target, self.dtype)
        for new, rows_kept in zip(out.data, kept, strict=True):
            new[:-1] = rows_kept
        out.positions[:-1] = positions
        if received is not None:
            out.received = torch.cat([received, received.new_zeros(1, received.shape[1])])
        return out

    def row_nbytes(self, row: int) -> int:
        """Bytes of one sequence's stored keys and values."""
        return sum(self.lengths[row * self.heads : (row + 1) * self.heads]) * self.entry_bytes()

    @property
    def group(self) -> int:
        """Query heads per kv-head that `received` counts (0 when it is not kept)."""
        return 0 if self.received is None else self.received.shape[1]

    def _received_grid(self) -> torch.Tensor:
        grid = self.received[:-1].view(self.rows, self.heads, self.capacity[0], self.group)  # an empty body too
        return grid.narrow(2, 0, self.lengths[0])

    def padded_received(self) -> torch.Tensor:
        """`received` in the shape of `padded()`: `[rows, heads, length, group]` (padding slots hold 0)."""
        if self.received is None:
            raise ValueError("this layer keeps no attention sums; a scorer that reads them must ask for them")
        if self.grid:
            return self._received_grid()
        return self.received.index_select(0, self.slots.view(-1)).view(self.rows, self.heads, -1, self.group)

    def add_received(self, received: torch.Tensor) -> None:
        """Add `[rows, heads, length, group]` attention (laid out as `padded()`) to the entries' sums."""
        if self.received is None:
            self.received = received.new_zeros(self.null_index + 1, received.shape[-1], dtype=torch.float32)
        if self.grid:
            self._received_grid().add_(received)
        else:
            self.received.index_add_(0, self.slots.view(-1), received.reshape(-1, self.group).float())
            self.received[-1] = 0


def _with_extra(
    codec: EntryCodec,
    kept: tuple[torch.Tensor, ...],
    positions: torch.Tensor,
    received: torch.Tensor | None,
    lengths: list[int],
    extra: Sequence[Entries],
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor | None, list[int]]:
    """Kept rows with every segment's `extra` entries encoded and placed after its own (flat, segment by segment).

    `extra` carries the attention its entries received exactly when the kept rows do.
    """
    encoded = codec.encode(torch.cat([e.keys for e in extra]), torch.cat([e.values for e in extra]))
    first, second = 0, sum(lengths)
    pieces = []
    for own, entries in zip(lengths, extra, strict=True):
        pieces += [torch.arange(first, first + own), torch.arange(second, second + len(entries))]
        first, second = first + own, second + len(entries)
    order = torch.cat(pieces).to(positions.device)
    rows = tuple(torch.cat([k, e]).index_select(0, order) for k, e in zip(kept, encoded, strict=True))
    positions = torch.cat([positions, *(e.positions for e in extra)]).index_select(0, order)
    if received is not None:
        received = torch.cat([received, *(e.received for e in extra)]).index_select(0, order)
    return rows, positions, received, [own + len(e) for own, e in zip(lengths, extra, strict=True)]
