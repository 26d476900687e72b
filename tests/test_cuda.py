"""CUDA paths: the fused varlen kernel and whole-model exactness on a GPU (run where one is present)."""

from __future__ import annotations

import pytest
import torch

import kvsieve
from conftest import tiny_llama
from kvsieve.runtime.kernels import reference_attention, varlen_attention, varlen_available
from kvsieve.runtime.segments import Segments

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none in CI)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_varlen_kernel_equals_the_reference_on_grid_and_packed_storage(dtype):
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(2, 3, 50, 16, generator=gen)
    segments = Segments.from_dense(dense.cuda().to(dtype), (dense + 1).cuda().to(dtype), torch.arange(50).cuda())
    lengths = [50, 31, 7, 50, 12, 40]
    packed = segments.select(list(range(6)), [torch.arange(n).cuda() for n in lengths], rows=2)
    grid = segments.select(list(range(6)), [torch.arange(30).cuda()] * 6, rows=2)
    grid.append(*(torch.randn(2, 3, 1, 16, generator=gen).cuda().to(dtype),) * 2, torch.tensor([50]).cuda())
    query = torch.randn(2, 6, 1, 16, generator=gen).cuda().to(dtype)
    assert varlen_available(query)
    for store in (packed, grid):
        view = store.padded()
        valid = view.slots.valid()
        got = varlen_attention(query, view.keys, view.values, None if valid is None else valid.sum(-1), 0.25)
        visible = None if valid is None else valid[:, :, None, :]
        expected = reference_attention(query, view.keys, view.values, visible, 0.25)
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("spec", ["snapkv", "snapkv+adaptive", "importance+global"])
@torch.no_grad()
def test_compressed_decoding_on_cuda_equals_the_masked_reference(masked_reference, dtype, atol, spec):
    model = tiny_llama(seed=3).cuda().to(dtype)
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(1)).cuda()
    cache = kvsieve.compress(model, ids[:, :100], spec, 0.7, n_recent=8)
    kept = [cache.kept_positions(layer) for layer in range(3)]
    with kvsieve.sieve_attention(model):
        steps = [model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(100, 110)]
        rest = model(ids[:, 110:], past_key_values=cache).logits
    with masked_reference(model, ids[:, :100], kept) as ref:
        expected = model(ids[:, 100:], past_key_values=ref.cache).logits
    torch.testing.assert_close(torch.cat([*steps, rest], dim=1).float(), expected.float(), atol=atol, rtol=0)
