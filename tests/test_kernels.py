"""Attention kernels over padded ragged entries against float64 references."""

from __future__ import annotations

import pytest
import torch

from kvsieve.kernels.attention import masked_sdpa, observed_attention, reference_attention


def _ragged(rows: int, kv_heads: int, group: int, q: int, length: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, kv_heads * group, q, 8, generator=gen)
    keys = torch.randn(rows, kv_heads, length, 8, generator=gen)
    values = torch.randn(rows, kv_heads, length, 8, generator=gen)
    visible = torch.rand(rows, kv_heads, q, length, generator=gen) < 0.6
    visible[..., 0] = True  # every query sees at least one entry
    return query, keys, values, visible


@pytest.mark.parametrize("q", [1, 5])
@pytest.mark.parametrize("group", [1, 3])
def test_masked_sdpa_equals_the_float64_reference(q, group):
    query, keys, values, visible = _ragged(rows=2, kv_heads=3, group=group, q=q, length=40, seed=q + group)
    got = masked_sdpa(query, keys, values, visible, scaling=0.3)
    assert got.shape == (2, q, 3 * group, 8)
    torch.testing.assert_close(got, reference_attention(query, keys, values, visible, 0.3), atol=1e-5, rtol=0)
    everything = masked_sdpa(query, keys, values, None, 0.3)
    torch.testing.assert_close(everything, reference_attention(query, keys, values, None, 0.3), atol=1e-5, rtol=0)
    assert (everything - got).abs().max() > 1e-2, "the mask must matter"


def test_observed_attention_equals_dense_attention_and_column_sums():
    """Output and received attention of a padded, causal prefill against an explicit float64 computation."""
    rows, kv_heads, group, n = 2, 2, 3, 30
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(rows, kv_heads * group, n, 8, generator=gen)
    keys = torch.randn(rows, kv_heads, n, 8, generator=gen)
    values = torch.randn(rows, kv_heads, n, 8, generator=gen)
    real = torch.ones(rows, n, dtype=torch.bool)
    real[1, :7] = False  # left padding
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    mask = (causal[None] & real[:, None, :])[:, None]
    mask |= ~mask.any(dim=-1, keepdim=True)  # padding queries see everything, as transformers' SDPA mask makes them
    out, received = observed_attention(query, keys, values, mask, 0.4, real.float())

    expand = keys.double().repeat_interleave(group, dim=1), values.double().repeat_interleave(group, dim=1)
    scores = (query.double() @ expand[0].transpose(-1, -2)) * 0.4
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    torch.testing.assert_close(out, (probs @ expand[1]).transpose(1, 2).float(), atol=1e-5, rtol=0)
    expected = (probs * real[:, None, :, None]).sum(dim=2).float()
    torch.testing.assert_close(received, expected, atol=1e-5, rtol=0)
    assert received[1, :, :7].abs().max() < 1e-6, "nobody attends padding"


def _documented_varlen(query, key, value, cu_q, cu_k, max_q, max_k, *, scale, enable_gqa, seqused_k):
    """torch's `varlen_attn` as its documentation describes it (no causal window), in float64, for CPU tests."""
    out = torch.empty_like(query)
    group = query.shape[1] // key.shape[1]
    for i in range(len(cu_q) - 1):
        q = query[cu_q[i] : cu_q[i + 1]].double()  # [tq, hq, d]
        k = key[cu_k[i] : cu_k[i] + seqused_k[i]].double().repeat_interleave(group, dim=1)
        v = value[cu_k[i] : cu_k[i] + seqused_k[i]].double().repeat_interleave(group, dim=1)
        probs = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * scale, dim=-1)
        out[cu_q[i] : cu_q[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def test_varlen_kernel_reads_padded_storage_in_place(monkeypatch):
    """The varlen call's packing (sequences, strides, lengths, GQA) against the kernel's documented semantics.

    The kernel itself needs CUDA (tests/test_cuda.py runs it there); here it is replaced by its documented
    behaviour so that how kvsieve lays out grid and packed storage for it is checked on every machine.
    """
    from kvsieve.kernels import attention as kernels
    from kvsieve.runtime.storage.segments import Segments

    monkeypatch.setattr(kernels, "_varlen_kernel", lambda: _documented_varlen)
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(2, 3, 50, 8, generator=gen)
    segments = Segments.from_dense(dense, dense + 1, torch.arange(50))
    packed = segments.select(list(range(6)), [torch.arange(n) for n in (50, 31, 7, 50, 12, 40)], rows=2)
    grid = segments.select(list(range(6)), [torch.arange(30)] * 6, rows=2)
    grid.append(*(torch.randn(2, 3, 1, 8, generator=gen),) * 2, torch.tensor([50]))
    query = torch.randn(2, 6, 1, 8, generator=gen)
    for store in (packed, grid):
        view = store.padded()
        assert store is packed or view.keys.stride(1) > view.keys.shape[2] * 8, "a grid view into wider storage"
        valid = view.slots.valid()
        got = kernels.varlen_attention(query, view.keys, view.values, None if valid is None else valid.sum(-1), 0.3)
        visible = None if valid is None else valid[:, :, None, :]
        torch.testing.assert_close(got, reference_attention(query, view.keys, view.values, visible, 0.3))
