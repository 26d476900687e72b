"""kvpress under fewer bits: its presses over `transformers`' quantized cache (optimum-quanto), and real bytes.

kvpress compresses a `transformers.QuantizedCache` as it does a `DynamicCache`: during the prefill
each layer's entries are read back (dequantized), scored and pruned, and the kept ones quantized
again, all of them, so none stays in full precision after the prefill. Decoding appends new tokens
in full precision until `residual_length` (transformers' default, 128) of them are held, then the
layer is read back and quantized whole again.

With the `quanto` backend (`optimum-quanto`, 2 or 4 bits; the one kvpress documents) and
`axis=0`, every group of `group` consecutive channels of one entry shares a scale and a shift:
the layout kvsieve's own quantized entries use (one scale and minimum per 32 channels), so the two
libraries' bytes per entry are the same and a table compares their choices, not their packing.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import Cache, PreTrainedConfig, QuantizedCache
from transformers.cache_utils import QuantizedLayer, QuantoQuantizedLayer

from ...runtime.compat import query_length
from .. import install_hint

#: Bits per number kvpress's quantized cache stores here (optimum-quanto's qint2 and qint4).
KVPRESS_KV_BITS = (2, 4)
QUANTO_HINT = f"{install_hint('compare')} (kvpress with optimum-quanto)"


class PrunedQuantizedLayer(QuantoQuantizedLayer):
    """transformers' quanto-quantized layer after a kvpress press: it reports the tokens it has seen.

    kvpress sets `cumulative_length` to the entries it kept; `n_missing` (set after the prefill)
    adds the pruned ones back, so new tokens get their true positions and the mask spans the stored
    entries shifted by the missing count, as `kvsieve.harness.compare.kvpress.PrunedLayer` does.
    """

    n_missing: int = 0

    def get_seq_length(self) -> int:
        return self.cumulative_length + self.n_missing

    def get_mask_sizes(self, query: torch.Tensor | int) -> tuple[int, int]:
        return self.cumulative_length + query_length(query), self.n_missing

    def __deepcopy__(self, memo: dict[int, Any]) -> PrunedQuantizedLayer:
        """A copy sharing the quantized tensors, which quanto cannot deep-copy; `update` replaces them, never
        changes them in place, so copies stay independent."""
        copied = copy.copy(self)
        copied.keys, copied.values = self.keys.clone(), self.values.clone()
        return copied


def check_kv_bits(kv_bits: int) -> None:
    """A clear error for widths kvpress's quantized cache does not store here."""
    if kv_bits not in (*KVPRESS_KV_BITS, 16):
        raise ValueError(
            f"kvpress stores kv_bits={kv_bits} nowhere here: its quantized cache (optimum-quanto) stores "
            f"{' or '.join(map(str, KVPRESS_KV_BITS))} bits, 16 is its full-precision cache"
        )


def quantized_cache(config: PreTrainedConfig, kv_bits: int, group: int) -> QuantizedCache:
    """A `QuantizedCache` (quanto backend, `kv_bits` per number, `group` channels per scale) whose layers report
    the tokens they have seen after a press (`PrunedQuantizedLayer`)."""
    try:
        cache = QuantizedCache("quanto", config, nbits=kv_bits, q_group_size=group)
    except ImportError as err:
        raise ImportError(f"kvpress's quantized cache needs optimum-quanto: {QUANTO_HINT}") from err
    cache.layers = [PrunedQuantizedLayer(kv_bits, 0, 0, group, layer.residual_length) for layer in cache.layers]
    return cache


def mark_pruned(cache: QuantizedCache, n_context: int) -> None:
    """After the press: every layer counts the `n_context` tokens it has seen, kept or not, and its empty
    full-precision part (kvpress leaves a 1-D placeholder) takes the layer's shape `[rows, heads, 0, d]`."""
    for layer in cache.layers:
        layer.n_missing = n_context - layer.cumulative_length
        rows, heads, _, dim = layer._quantized_keys.shape
        layer.keys = layer.keys.new_zeros(rows, heads, 0, dim)
        layer.values = layer.values.new_zeros(rows, heads, 0, layer._quantized_values.shape[-1])


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds; a quantized tensor subclass (codes, scales, shifts) is summed over its parts."""
    if not hasattr(tensor, "__tensor_flatten__"):  # a plain tensor
        return tensor.numel() * tensor.element_size()
    names, _ = tensor.__tensor_flatten__()
    return sum(tensor_nbytes(getattr(tensor, name)) for name in names)


def cache_nbytes(cache: Cache) -> int:
    """Bytes of keys and values a kvpress cache holds: full-precision tensors, and a quantized layer's codes,
    scales and shifts with its full-precision residual."""
    total = 0
    for layer in cache.layers:
        tensors = [layer.keys, layer.values]
        if isinstance(layer, QuantizedLayer):
            tensors += [layer._quantized_keys, layer._quantized_values]
        total += sum(tensor_nbytes(t) for t in tensors)
    return total
