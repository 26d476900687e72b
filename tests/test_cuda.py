"""CUDA paths: the fused varlen kernel, whole-model exactness and gate training on a GPU (run where one is present)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import kvsieve
from conftest import tiny_llama
from kvsieve.harness.cli import app
from kvsieve.harness.models import load_model
from kvsieve.harness.training.retention import decayed_attention, masked_decayed_attention
from kvsieve.kernels.attention import VARLEN_ARGUMENTS, reference_attention, varlen_attention, varlen_available
from kvsieve.runtime.storage.codecs import codec_for
from kvsieve.runtime.storage.segments import Segments
from kvsieve.selection.checkpoint import read_gates
from kvsieve.selection.storage import Storage
from test_corpus import write_corpus

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
    if not varlen_available(query):
        pytest.skip(f"torch {torch.__version__}'s varlen kernel lacks {VARLEN_ARGUMENTS}; decoding uses the reference")
    for store in (packed, grid):
        view = store.padded()
        valid = view.slots.valid()
        got = varlen_attention(query, view.keys, view.values, None if valid is None else valid.sum(-1), 0.25)
        visible = None if valid is None else valid[:, :, None, :]
        expected = reference_attention(query, view.keys, view.values, visible, 0.25)
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("spec", ["snapkv", "snapkv+adaptive", "importance+global", "dropkv+adaptive"])
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


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("storage", [{"kv_bits": 8}, {"kv_bits": 4}, {"kv_bits": 2}, {"kv_codec": "fp8"}], ids=str)
@torch.no_grad()
def test_quantized_decoding_on_cuda_equals_the_masked_reference_on_the_dequantized_entries(
    masked_reference, dtype, atol, storage
):
    """Codes, scales and the residual live on the GPU; decoding reads them back as the float64 reference does."""
    model = tiny_llama(seed=3).cuda().to(dtype)
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(1)).cuda()
    codec = codec_for(Storage(**storage, kv_group=8, kv_residual=8), 16)
    cache = kvsieve.compress(model, ids[:, :100], "snapkv+adaptive", 0.7, n_recent=8, kv_group=8, kv_residual=8,
                             **storage)  # fmt: skip
    assert all(t.device.type == "cuda" for layer in cache.layers for t in layer.segments.body.data)
    kept = [cache.kept_positions(layer) for layer in range(3)]
    with kvsieve.sieve_attention(model):
        steps = [model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(100, 110)]
    with masked_reference(model, ids[:, :100], kept, codec=codec) as ref:
        expected = [model(ids[:, t : t + 1], past_key_values=ref.cache).logits for t in range(100, 110)]
    torch.testing.assert_close(torch.cat(steps, 1).float(), torch.cat(expected, 1).float(), atol=atol, rtol=0)


@torch.no_grad()
def test_a_bounded_dropkv_cache_on_cuda_keeps_its_outputs_valid():
    """The outputs dropkv reads are re-measured on the GPU after every eviction: equal to the eager softmax."""
    model = tiny_llama(seed=3).cuda()
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(1)).cuda()
    cache = kvsieve.compress(model, ids[:, :60], "dropkv", max_tokens=40, buffer=8, window=4)
    with kvsieve.sieve_attention(model):
        for t in range(60, 100):
            model(ids[:, t : t + 1], past_key_values=cache)
    for obs in cache.growth.observations(cache, 0):
        queries, positions = obs.queries(4)
        keys, values, at, valid = (
            t.repeat_interleave(obs.group, dim=0) for t in (obs.keys, obs.values, obs.positions, obs.valid_mask)
        )
        hidden = (at[:, None, :] > positions[None, :, None]) | ~valid[:, None, :]
        logits = (queries.double() @ keys.double().transpose(1, 2)) * obs.scaling
        expected = torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1) @ values.double()
        held = obs.stats.window["attention_outputs"]
        assert held.device.type == "cuda"
        torch.testing.assert_close(held.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("length", [200, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decay_bias_on_cuda_equals_the_explicit_bias(dtype, length):
    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, n, length, 32, generator=gen).cuda().to(dtype) for n in (4, 2, 2))
    log_beta = (-torch.rand(2, 2, length, generator=gen) / 50).cuda().requires_grad_()
    fused = decayed_attention(query, key, value, log_beta, 0.2)
    (grad_fused,) = torch.autograd.grad(fused.float().square().sum(), log_beta)
    explicit = masked_decayed_attention(query.float(), key.float(), value.float(), log_beta, 0.2)
    (grad_explicit,) = torch.autograd.grad(explicit.square().sum(), log_beta)
    atol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(fused.float(), explicit, atol=atol, rtol=0)
    assert (grad_fused - grad_explicit).norm() < atol * grad_explicit.norm(), "the gates get the same gradient"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_train_gates_runs_on_cuda_and_the_gates_evict_there(model_dir, tmp_path, dtype):
    out = tmp_path / "gates"
    args = ["train-gates", "--model", str(model_dir), "--out", str(out), "--steps", "12", "--seq-len", "64"]
    args += ["--capacity", "8", "--lr", "0.05", "--data", str(write_corpus(tmp_path / "corpus"))]
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--device", "cuda", "--dtype", dtype])
    assert result.exit_code == 0, result.output
    gates, record = read_gates(out)
    assert record.architecture == "LlamaForCausalLM" and all(p.device.type == "cpu" for p in gates.parameters())
    model, _ = load_model(str(model_dir), dtype=getattr(torch, dtype), device="cuda")
    ids = torch.randint(1, 128, (1, 80), generator=torch.Generator().manual_seed(2)).cuda()
    cache = kvsieve.compress(model, ids, f"trimkv+global:gates={out}", rate=0.5)
    on_cpu = kvsieve.compress(load_model(str(model_dir))[0], ids.cpu(), f"trimkv+global:gates={out}", rate=0.5)
    assert cache.mean_stored() == on_cpu.mean_stored() < 80, "the same share is evicted on both devices"


def _command_json(args: list[str], out) -> dict:
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


@pytest.mark.parametrize("protocol", [[], ["--stream", "--max-tokens", "48", "--doc-tokens", "160", "--buffer", "16"]])
def test_perplexity_on_cuda_equals_the_cpu(model_dir, tmp_path, protocol):
    args = ["ppl", "--model", str(model_dir), "--docs", "2", "--policies", "snapkv", *protocol]
    args += [] if protocol else ["--prefix", "64", "--continuation", "32", "--rates", "0.5"]
    cpu = _command_json(args, tmp_path / "cpu.json")
    cuda = _command_json([*args, "--device", "cuda"], tmp_path / "cuda.json")
    for ours, theirs in zip(cuda["rows"], cpu["rows"], strict=True):
        assert ours["ppl"] == pytest.approx(theirs["ppl"], rel=1e-3)


def test_sweep_and_diagnose_run_on_cuda(model_dir, tmp_path):
    common = ["--model", str(model_dir), "--tasks", "hops,niah_multikey_1", "--rates", "0.5", "--samples", "1"]
    common += ["--length", "384", "--modes", "agnostic,aware", "--device", "cuda", "--dtype", "bfloat16"]
    runner = CliRunner(env={"COLUMNS": "200"})
    sweep = runner.invoke(
        app, ["sweep", *common, "--policies", "snapkv,trimkv+global:gates=untrained", "--out", str(tmp_path / "s")]
    )
    assert sweep.exit_code == 0, sweep.output
    diagnose = runner.invoke(app, ["diagnose", *common, "--scalars", "snapkv", "--out", str(tmp_path / "d")])
    assert diagnose.exit_code == 0, diagnose.output
    assert (tmp_path / "d" / "diagnostic.md").exists()
