"""kvsieve inside vLLM's CPU build over a request's life: chunked prefill compacted chunk by chunk, a prefix shared
with other requests, preemption, aborts, parallel samples and a prompt longer than the engine (`make vllm`; the
engine helpers and fixtures are tests/test_vllm.py's)."""

from __future__ import annotations

import json

import pytest
import torch

from extras import require

vllm = require("vllm", "vllm")

import kvsieve  # noqa: E402
import test_vllm  # noqa: E402
from kvsieve.runtime.compat import cache_argument  # noqa: E402
from test_vllm import (  # noqa: E402
    BLOCK,
    KvsieveRun,
    assert_same_decisions,
    engine,
    generate,
    greedy,
    kvsieve_greedy,
    run_alone,
    scheduler,
)

# tests/test_vllm.py's fixtures, which pytest finds here by their names
folder, reference, prompts, compactions = (
    test_vllm.folder,
    test_vllm.reference,
    test_vllm.prompts,
    test_vllm.compactions,
)

pytestmark = pytest.mark.integration


def chunked_greedy(model, ids: list[int], n: int, policy: str, chunk: int, size: int) -> KvsieveRun:
    """kvsieve's chunked prefill held at `size` (`compress(..., chunk=)`): the first token from the last chunk's
    forward over the cache its earlier chunks left, the rest from the cache the whole prompt leaves."""
    last = (len(ids) - 1) // chunk * chunk
    before = kvsieve.compress(model, torch.tensor([ids[:last]]), policy, max_tokens=size, chunk=chunk)
    with torch.no_grad(), kvsieve.sieve_attention(model):
        logits = model(input_ids=torch.tensor([ids[last:]]), **cache_argument(model, before), use_cache=True).logits
    first = logits[0, -1].log_softmax(-1)
    cache = kvsieve.compress(model, torch.tensor([ids]), policy, max_tokens=size, chunk=chunk)
    kept = [[p.clone() for p in cache.kept_positions(layer)] for layer in cache.full_layers]
    out = kvsieve.generate(model, first.argmax().view(1, 1), cache=cache, max_new_tokens=n - 1, do_sample=False)
    return KvsieveRun(out[0].tolist(), first[None], kept, 0)


@pytest.mark.parametrize(
    ("policy", "budget"),
    [("snapkv", {"rate": 0.75}), ("snapkv+adaptive", {"max_tokens": 150}), ("trimkv+global", {"rate": 0.75})],
)
def test_a_prompt_prefilled_in_chunks_is_compacted_after_each(folder, reference, prompts, compactions, policy, budget):
    """No admission peak: under chunked prefill a request is compacted after every chunk, to the size its budget
    gives its whole prompt, as `compress(..., chunk=)` holds it; it never holds more than that size plus a chunk."""
    model, _ = reference
    ids, n, chunk = prompts[0], 8, 128
    size = budget.get("max_tokens") or len(kvsieve_greedy(model, ids, 2, "snapkv", **budget).kept[0][0])
    ours = chunked_greedy(model, ids, n, policy, chunk, size)
    with engine(folder, {"policy": policy, **budget}, max_num_batched_tokens=chunk, enable_chunked_prefill=True) as llm:
        done, held = run_alone(llm, ids, n)
    assert [c.seen for c in compactions] == [256, 384, 512, len(ids)]  # when the next chunk would pass size + chunk
    assert_same_decisions(model, ids, policy, compactions[-1].kept, ours.kept)
    assert list(done.outputs[0].token_ids) == ours.tokens
    assert max(held) <= -(-(size + chunk) // BLOCK) + 1


def test_a_shared_prefix_is_cached_once_and_never_rewritten(folder, reference, compactions):
    """Prefix caching on (vLLM's default): four requests that begin with the same 384-token instruction (three
    blocks) hold those blocks once; each compacts its own part only (the prefix protected, kept where it is) and
    gives the tokens kvsieve gives with that prefix protected."""
    from kvsieve.harness.data.haystack import essay_words

    model, tokenizer = reference
    words = essay_words()
    instruction = tokenizer(" ".join(words[:400])).input_ids[:384]
    documents = [
        tokenizer(" " + " ".join(words[start : start + 260])).input_ids[:200] for start in range(1000, 5000, 1000)
    ]
    prompts = [instruction + document for document in documents]
    with engine(folder, {"policy": "snapkv", "rate": 0.75}, blocks=32) as llm:
        outputs = generate(llm, prompts, 8)
    assert sorted(c.seen for c in compactions) == [len(ids) for ids in prompts]
    assert len({tuple(c.blocks[:3]) for c in compactions}) == 1  # the instruction's blocks, allocated once
    assert all(c.shared == 384 for c in compactions)
    for c in compactions:
        assert all(set(range(384)) <= set(head.tolist()) for layer in c.kept.values() for head in layer)
    protect = torch.arange(384)
    for ids, out in zip(prompts, outputs, strict=True):
        assert (
            list(out.token_ids) == kvsieve_greedy(model, ids, 8, "snapkv", rate=0.75, protect_positions=protect).tokens
        )


def test_preempted_requests_complete(folder, prompts, tmp_path, compactions):
    """Three requests whose caches outgrow 7 blocks while generating: vLLM preempts, each prefills again (its
    prompt and what it generated, compacted again, once) and finishes."""
    trace = tmp_path / "trace.jsonl"
    three = [*prompts, prompts[0][100:]]
    with engine(folder, {"policy": "snapkv", "rate": 0.75, "trace": str(trace)}, blocks=8, max_model_len=896) as llm:
        outputs = generate(llm, three, 280)
        sched = scheduler(llm)
        assert not sched.kvsieve_hits and not sched.kvsieve_shared  # nothing left of the finished requests
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    preempted = sum(step["preempted"] for step in steps)
    assert preempted >= 1
    assert len(compactions) == 3 + preempted  # each prefill compacted once: no loop
    assert [len(out.token_ids) for out in outputs] == [280] * 3
    assert steps[-1]["blocks_in_use"] == 0


def run_until_done(llm, steps: int = 1000) -> list:
    """Step the engine until no request is left; the finished outputs."""
    core, done = llm.llm_engine, []
    for _ in range(steps):
        if not core.has_unfinished_requests():
            return done
        done += [out for out in core.step() if out.finished]
    raise AssertionError(f"requests still unfinished after {steps} steps")


@pytest.mark.parametrize("policy", ["snapkv", "snapkv+global", "trimkv+global"])
def test_requests_aborted_or_finishing_while_compacted_free_everything(folder, prompts, policy):
    """Aborted during the prefill (chunked) and during decoding, finishing in the step that compacts it
    (`max_tokens=1`): every block comes back, no state is left, and the next request runs as alone."""
    chunked = {"max_num_batched_tokens": 128, "enable_chunked_prefill": True}
    with engine(folder, {"policy": policy, "rate": 0.75}, **chunked) as llm:
        (alone,) = generate(llm, [prompts[1]], 16)
    with engine(folder, {"policy": policy, "rate": 0.75}, **chunked) as llm:
        sched, core = scheduler(llm), llm.llm_engine
        pool = sched.kv_cache_manager.block_pool
        free = pool.get_num_free_blocks()
        core.add_request("prefilling", {"prompt_token_ids": prompts[0]}, greedy(32))
        core.step()  # its first chunk
        core.abort_request(["prefilling"])
        core.add_request("decoding", {"prompt_token_ids": prompts[0]}, greedy(64))
        for _ in range(8):  # five chunks, then decoding
            core.step()
        core.abort_request(["decoding"])
        core.add_request("one token", {"prompt_token_ids": prompts[0]}, greedy(1))
        (one,) = run_until_done(llm)
        assert len(one.outputs[0].token_ids) == 1
        core.add_request("after", {"prompt_token_ids": prompts[1]}, greedy(16))
        (after,) = run_until_done(llm)
        run_until_done(llm)
        assert pool.get_num_free_blocks() == free
        assert not sched.kvsieve_hits and not sched.kvsieve_shared
    assert list(after.outputs[0].token_ids) == list(alone.token_ids)


def test_parallel_samples_share_the_prompt_blocks(folder, prompts, compactions):
    """`n=2`: the two samples find the prompt's full blocks in the prefix cache of each other, keep them whole
    (shared) and compact only what follows; both finish."""
    ids = prompts[0]
    with engine(folder, {"policy": "snapkv", "rate": 0.75}) as llm:
        (out,) = llm.generate(
            [{"prompt_token_ids": ids}], vllm.SamplingParams(n=2, max_tokens=16, seed=0), use_tqdm=False
        )
    assert [len(sample.token_ids) for sample in out.outputs] == [16, 16]
    full = len(ids) // BLOCK * BLOCK
    assert [c.shared for c in compactions] == [full, full]
    assert compactions[0].blocks[: full // BLOCK] == compactions[1].blocks[: full // BLOCK]


def test_a_prompt_longer_than_the_engine_holds_is_vllms_error_alone(folder, prompts):
    from vllm.exceptions import VLLMValidationError

    with engine(folder, {"policy": "snapkv", "rate": 0.75}, blocks=8, max_model_len=896) as llm:
        core = llm.llm_engine
        with pytest.raises(VLLMValidationError, match="maximum context length is 896 tokens"):
            core.add_request("long", {"prompt_token_ids": (prompts[0] * 2)[:1000]}, greedy(4))
        core.add_request("short", {"prompt_token_ids": prompts[1]}, greedy(4))
        (done,) = run_until_done(llm)
    assert len(done.outputs[0].token_ids) == 4
