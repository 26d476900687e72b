"""Lossy storage with a full-precision residual: old entries as codes, the newest of every segment as computed.

A layer whose codec is lossy (`EntryCodec.lossless` false: integer codes, float8) keeps its entries in two parts:
the *body*, a `Segments` of codes, and the *residual*, the newest `codec.residual` entries of every
(row, kv-head) in the model's dtype (KIVI's full-precision residual, arXiv 2402.02750), one grid
`[rows, heads, n, d]`. Appends go to the residual; entries that age out of it move to the body,
where they are stored once and never re-quantized.

Entries are read back quantized from the forward after the one that moves them to the body: the
forward that moves them (out of the residual, or a long forward's own first tokens) sees them as
they were computed. Measured on the default model (`benchmarks/kv_quant_layouts.py`),
quantizing the newest entries costs far more than quantizing the rest.

An eviction (`select`) keeps the residual a residual when every output segment keeps as many of
its entries (a policy's protected recent tail covers it); otherwise the kept residual entries are
quantized into the body and the residual starts empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ...selection.errors import PolicyError
from .codecs import EntryCodec
from .segments import PAD_POSITION, Entries, PaddedView, Segments, Slots


@dataclass(frozen=True)
class Residual:
    """The newest entries of every (row, kv-head), as computed: keys and values `[rows, heads, n, d]`, cache
    positions `[rows, heads, n]`, and the attention each received (`[rows, heads, n, group]`, if kept)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    received: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.positions.shape[-1])

    def narrow(self, start: int, length: int) -> Residual:
        """Entries `start .. start + length - 1` of every segment."""
        received = None if self.received is None else self.received.narrow(2, start, length)
        return Residual(*(t.narrow(2, start, length) for t in (self.keys, self.values, self.positions)), received)

    def entries(self, segment: int, heads: int, index: torch.Tensor) -> Entries:
        """Entries `index` of one segment (`row * heads + head`)."""
        row, head = divmod(segment, heads)
        received = None if self.received is None else self.received[row, head, index]
        keys, values = self.keys[row, head, index], self.values[row, head, index]
        return Entries(keys, values, self.positions[row, head, index], received)

    @classmethod
    def stacked(cls, entries: Sequence[Entries], heads: int) -> Residual:
        """The residual whose segment `i` holds `entries[i]` (as many in each)."""

        def grid(tensors: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack(tensors).unflatten(0, (-1, heads))

        received = None if entries[0].received is None else grid([e.received for e in entries])
        return cls(
            grid([e.keys for e in entries]),
            grid([e.values for e in entries]),
            grid([e.positions for e in entries]),
            received,
        )


def _cat(first: Residual, second: Residual) -> Residual:
    received = None
    if first.received is not None:
        received = torch.cat([first.received, second.received], dim=2)
    return Residual(*(torch.cat([a, b], dim=2) for a, b in zip(
        (first.keys, first.values, first.positions), (second.keys, second.values, second.positions), strict=True
    )), received)  # fmt: skip


def _as_they_were(body: PaddedView, moved: Residual, lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`body`'s keys and values with the entries `moved` to the end of every segment as they were, not read back."""
    if moved.length == 0:
        return body.keys, body.values
    rows, heads, _, dim = moved.keys.shape
    device = moved.keys.device
    ends = torch.tensor(lengths, device=device).view(rows, heads, 1)
    columns = (ends - moved.length + torch.arange(moved.length, device=device))[..., None].expand(-1, -1, -1, dim)
    return body.keys.scatter(2, columns, moved.keys), body.values.scatter(2, columns, moved.values)


def _scattered(
    body: torch.Tensor, columns: torch.Tensor, residual: torch.Tensor, width: int, fill: float = 0.0
) -> torch.Tensor:
    """`body` (`[rows, heads, w, ...]`) widened to `width` (filled with `fill`), `residual` (`[rows, heads, n, ...]`)
    written at `columns` (`[rows, heads, n]`)."""
    out = body.new_full((*body.shape[:2], width, *body.shape[3:]), fill)
    out[:, :, : body.shape[2]] = body
    index = columns.view(*columns.shape, *([1] * (body.dim() - 3))).expand(residual.shape)
    return out.scatter(2, index, residual)


class QuantizedSegments:
    """The entries of one layer: a quantized `body` and a full-precision `residual` (see the module doc)."""

    def __init__(self, body: Segments, residual: Residual) -> None:
        self.body = body
        self.codec: EntryCodec = body.codec
        self.residual = residual

    @classmethod
    def from_dense(
        cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, codec: EntryCodec
    ) -> tuple[QuantizedSegments, PaddedView]:
        """Store `[rows, heads, n, d]` states at cache positions `[n]` (the newest `codec.residual` as they are), and
        the view the forward that computed them reads (every one as computed)."""
        rows, heads, n, _ = keys.shape
        old = max(0, n - codec.residual)
        body = Segments.from_dense(keys[:, :, :old], values[:, :, :old], positions[:old], codec)
        states = Residual(keys, values, positions.expand(rows, heads, n))
        out = cls(body, states.narrow(old, n - old))
        return out, out._view(body.padded(), states.narrow(0, old))

    # ---------------------------------------------------------------- sizes

    @property
    def rows(self) -> int:
        return self.body.rows

    @property
    def heads(self) -> int:
        return self.body.heads

    @property
    def dtype(self) -> torch.dtype:
        return self.body.dtype

    @property
    def lengths(self) -> list[int]:
        return [n + self.residual.length for n in self.body.lengths]

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    @property
    def received(self) -> torch.Tensor | None:
        """The body's attention sums (the residual keeps its own beside them)."""
        return self.body.received

    @property
    def group(self) -> int:
        return self.body.group

    def entry_bytes(self) -> int:
        """Bytes of one quantized entry (a residual entry takes the model's dtype: `codec.residual_bytes` more)."""
        return self.body.entry_bytes()

    def _residual_entry_bytes(self) -> int:
        return 2 * self.residual.keys.shape[-1] * self.residual.keys.element_size()

    def nbytes(self) -> int:
        return sum(self.row_nbytes(row) for row in range(self.rows))

    def row_nbytes(self, row: int) -> int:
        """Bytes one sequence's entries take in this layer: codes and scales, and its residual."""
        return self.body.row_nbytes(row) + self.heads * self.residual.length * self._residual_entry_bytes()

    def allocated_nbytes(self) -> int:
        residual = (self.residual.keys, self.residual.values, self.residual.received)
        return self.body.allocated_nbytes() + sum(t.untyped_storage().nbytes() for t in residual if t is not None)

    # ---------------------------------------------------------------- reading

    def segment(self, row: int, head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys `[n, d]`, values `[n, d]` (read back) and positions `[n]` of one segment: body, then residual."""
        keys, values, positions = self.body.segment(row, head)
        r = self.residual
        return (
            torch.cat([keys, r.keys[row, head]]),
            torch.cat([values, r.values[row, head]]),
            torch.cat([positions, r.positions[row, head]]),
        )

    def padded(self) -> PaddedView:
        """The body read back (padded per segment), then the residual."""
        return self._view(self.body.padded())

    def _view(self, body: PaddedView, moved: Residual | None = None) -> PaddedView:
        """`body` (the entries `moved` there last, at the end of every segment, as they were), each segment's
        residual right after its own entries: column `i` of a segment is its stored entry `i`, padding last."""
        keys, values = (body.keys, body.values) if moved is None else _as_they_were(body, moved, self.body.lengths)
        positions, bias = body.slots.positions(), body.slots.bias
        if self.residual.length == 0:
            return PaddedView(keys, values, body.slots)
        if bias is None:  # every segment is full: the residual follows every row
            residual = self.residual
            return PaddedView(
                torch.cat([keys, residual.keys], dim=2),
                torch.cat([values, residual.values], dim=2),
                Slots(None, torch.cat([positions, residual.positions], dim=2), None),
            )
        columns = self._residual_columns()
        width = keys.shape[2] + self.residual.length
        padding = torch.arange(width, device=bias.device) > columns[..., -1:]
        return PaddedView(
            _scattered(keys, columns, self.residual.keys, width),
            _scattered(values, columns, self.residual.values, width),
            Slots(
                torch.zeros(padding.shape, dtype=bias.dtype, device=bias.device).masked_fill_(padding, float("-inf")),
                _scattered(positions, columns, self.residual.positions, width, PAD_POSITION),
                None,
            ),
        )

    def _residual_columns(self) -> torch.Tensor:
        """`[rows, heads, n]`: the column of every residual entry in the padded view (after its segment's body)."""
        device = self.residual.positions.device
        lengths = torch.tensor(self.body.lengths, device=device).view(self.rows, self.heads, 1)
        return lengths + torch.arange(self.residual.length, device=device)

    def padded_received(self) -> torch.Tensor:
        """The attention sums in the shape of `padded()`."""
        if self.residual.received is None:
            raise ValueError("this layer keeps no attention sums; a scorer that reads them must ask for them")
        body = self.body.padded_received()
        width = body.shape[2] + self.residual.length
        return _scattered(body, self._residual_columns(), self.residual.received, width)

    def add_received(self, received: torch.Tensor) -> None:
        """Add `[rows, heads, length, group]` attention (laid out as `padded()`) to the entries' sums."""
        columns = self._residual_columns()[..., None].expand(-1, -1, -1, received.shape[-1])
        tail = received.gather(2, columns).float()
        body = received.scatter(2, columns, 0.0)[:, :, : received.shape[2] - self.residual.length]
        self.body.add_received(body)
        own = self.residual.received
        self.residual = replace(self.residual, received=tail if own is None else own + tail)

    # ---------------------------------------------------------------- writing

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> PaddedView:
        """Append `[rows, heads, q, d]` states at cache positions `[q]`; what ages out of the residual is quantized.

        Returns the view the appending forward reads: what this append moved to the body as it was (it is
        read back quantized from the next forward on)."""
        rows, heads, q, _ = keys.shape
        received = None
        if self.residual.received is not None:
            received = self.residual.received.new_zeros(rows, heads, q, self.group)
        incoming = Residual(keys, values, positions.expand(rows, heads, q), received)
        held = _cat(self.residual, incoming)
        moving = held.narrow(0, max(0, held.length - self.codec.residual))
        body = self.body.padded()
        if moving.length:
            body = self.body.append(moving.keys, moving.values, moving.positions[0, 0], moving.received)
        kept = held.narrow(moving.length, held.length - moving.length)
        received = None if kept.received is None else kept.received.clone()
        self.residual = Residual(kept.keys.clone(), kept.values.clone(), kept.positions.clone(), received)
        return self._view(body, moving)

    def select(
        self, sources: Sequence[int], indices: Sequence[torch.Tensor], rows: int, codec: EntryCodec | None = None
    ) -> QuantizedSegments:
        """New storage: output segment `i` keeps entries `indices[i]` (body first, then residual) of `sources[i]`.

        Body entries move as codes. Kept residual entries stay a residual when every output keeps as many
        of them; otherwise they are quantized into the body.
        """
        if codec is not None and codec != self.codec:
            raise PolicyError(
                f"entries stored as {self.codec} are kept as they are stored; to store them otherwise, compress "
                "the prompt again with that storage"
            )
        body_kept, residual = [], []
        for source, index in zip(sources, indices, strict=True):
            index = index.to(self.residual.positions.device)
            stored = self.body.lengths[source]
            body_kept.append(index[index < stored])
            residual.append(self.residual.entries(source, self.heads, index[index >= stored] - stored))
        return _assembled(self.body, sources, body_kept, residual, rows, self.codec)


def _assembled(
    body: Segments,
    sources: Sequence[int],
    body_kept: Sequence[torch.Tensor],
    residual: Sequence[Entries],
    rows: int,
    codec: EntryCodec,
) -> QuantizedSegments:
    """Quantized storage of entries `body_kept[i]` of `body`'s segment `sources[i]`, then `residual[i]` (full
    precision): a residual if every output keeps as many, else quantized into the body after its own."""
    if len({len(entries) for entries in residual}) == 1:
        return QuantizedSegments(body.select(sources, body_kept, rows, codec), Residual.stacked(residual, body.heads))
    empty = [
        Entries(e.keys[:0], e.values[:0], e.positions[:0], None if e.received is None else e.received[:0])
        for e in residual
    ]
    return QuantizedSegments(
        body.select(sources, body_kept, rows, codec, residual), Residual.stacked(empty, body.heads)
    )


def stored_quantized(
    source: Segments, sources: Sequence[int], indices: Sequence[torch.Tensor], rows: int, codec: EntryCodec
) -> QuantizedSegments:
    """The kept entries of full-precision `source` stored by `codec` (compressing a prefill into fewer bits): those
    among each segment's newest `codec.residual` stay in full precision (see `QuantizedSegments.select`)."""
    body_kept, residual = [], []
    for s, index in zip(sources, indices, strict=True):
        index = index.to(source.positions.device)
        start = source.lengths[s] - codec.residual
        body_kept.append(index[index < start])
        residual.append(source.entries(s, index[index >= start]))
    return _assembled(source, sources, body_kept, residual, rows, codec)


#: How a cache layer stores its entries: in full precision (`Segments`) or lossy (`QuantizedSegments`).
Store = Segments | QuantizedSegments


def store_from_dense(
    keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, codec: EntryCodec
) -> tuple[Store, PaddedView]:
    """A layer's first states `[rows, heads, n, d]` at cache positions `[n]`, stored by `codec`, and the view the
    forward that computed them reads."""
    if not codec.lossless:
        return QuantizedSegments.from_dense(keys, values, positions, codec)
    store = Segments.from_dense(keys, values, positions, codec)
    return store, store.padded()


def kept_store(
    store: Store, sources: Sequence[int], indices: Sequence[torch.Tensor], rows: int, codec: EntryCodec
) -> Store:
    """`store.select`, the kept entries stored by `codec` (full precision into quantized: a compressed prefill)."""
    if isinstance(store, Segments) and not codec.lossless:
        return stored_quantized(store, sources, indices, rows, codec)
    return store.select(sources, indices, rows, codec)
