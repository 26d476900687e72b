"""Serving in vLLM with kvsieve: how many requests fit a fixed KV memory, how fast they go, what they still answer.

`--requests` needle prompts (RULER's `niah_single_2`, about `--prompt` tokens each, essay haystack,
question at the end) are submitted at once to vLLM's CPU build serving the default model in
bfloat16 with `--blocks` KV blocks of 128 tokens (the same memory for every row). Each request
generates `--new` tokens greedily (EOS ignored, so every row does the same work). Rows: vLLM as it
comes (the full cache, prefix caching on: the baseline), vLLM given room for every request at once
(the memory eviction saves), each of `--policies` at each rate and each of `--also` at 75%, all with
prefix caching on. A second shape puts a `--shared`-token instruction before `--prompt - --shared` tokens
of each request's own needle context (vLLM and `--policies` at 75 and 90%). Measured per row, every row
alike from vLLM's own metrics read after each engine step: the most requests running at once,
preemptions, KV blocks in use over time (`_blocks.png`); output and total tokens/s, the median time
to first token and per output token; how many needles were answered (RULER string match); and from
kvsieve's trace the blocks a request holds right after its compaction beside the blocks its mean count
per (layer, kv-head) needs.

Each row runs in a fresh process (a `vllm.LLM` in vLLM's default multi-process mode, eager). vLLM
sets torch to one thread on a 2-core machine; the table says what was used.

    .venv-vllm/bin/python benchmarks/vllm_serving.py [--requests 16] [--prompt 2000] [--new 256] [--blocks 72]
        [--policies trimkv+global] [--rates 0.5,0.75,0.9] [--also trimkv+adaptive,trimkv] [--shared 1000] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from results_io import RESULTS, Output

BLOCK = 128
VLLM, ROOMY = "vLLM", "vLLM, room for all"
#: vLLM's own metrics, read after every step: requests running, KV cache in use (a fraction), preemptions so far.
RUNNING, KV_USAGE, PREEMPTIONS = "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:num_preemptions"


def markdown(report: dict) -> str:
    from gates_provenance import gates_note
    from kvsieve.harness.report import markdown_table

    setup = report["setup"]
    lines = [
        f"vLLM {setup['vllm']} (CPU build), default model in bfloat16, {setup['requests']} requests of about "
        f"{setup['prompt_tokens']} prompt tokens submitted at once, each generating {setup['new']} tokens, KV memory "
        f"{setup['blocks']} blocks of {BLOCK} tokens ({setup['full_requests_fit']:.1f} full requests) unless the row "
        f"says otherwise; prefix caching on in every row; torch threads in vLLM's worker {setup['torch_threads']} "
        f"(vLLM's choice), {setup['cpus']} CPUs; eager mode." + gates_note(setup.get("default_gates")),
        "",
    ]
    header = [
        "prompt", "policy", "rate", "blocks", "most running", "preemptions", "output tok/s", "x vLLM",
        "total tok/s", "TTFT median s", "TPOT median ms", "needles answered", "blocks held / mean-count ideal",
    ]  # fmt: skip
    body = []
    for row in report["rows"]:
        full = next(r for r in report["rows"] if r["shared"] == row["shared"] and r["policy"] == VLLM)
        rate = "" if row["rate"] is None else f"{row['rate']:.0%}"
        shape = f"{row['shared']} shared + {row['prompt'] - row['shared']}" if row["shared"] else str(row["prompt"])
        cells = [shape, row["policy"], rate, row["blocks"], row["most_running"], row["preemptions"]]
        cells += [f"{row['output_tps']:.1f}", f"{row['output_tps'] / full['output_tps']:.2f}x"]
        cells += [f"{row['total_tps']:.0f}", f"{row['ttft_median']:.1f}", f"{1000 * row['tpot_median']:.0f}"]
        cells += [f"{row['answered']}/{row['requests']}"]
        held = row.get("held_blocks")
        cells += ["" if held is None else f"{held['blocks']:.1f} / {held['ideal']:.1f}"]
        body.append(["n/a" if cell is None else str(cell) for cell in cells])
    return "\n".join(lines) + "\n" + markdown_table(header, body) + "\n"


TABLE = Output("vllm_serving*", {"": markdown}, extras=("_blocks.png",))


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({row["shared"] for row in report["rows"]})
    fig, axes = plt.subplots(1, len(shapes), figsize=(7 * len(shapes), 4.5), squeeze=False)
    for ax, shared in zip(axes[0], shapes, strict=True):
        for row in report["rows"]:
            if row["shared"] != shared or row["policy"] == ROOMY or row["rate"] not in (None, 0.75):
                continue
            times, blocks = zip(*row["timeline"], strict=True)
            label = row["policy"] if row["rate"] is None else f"{row['policy']} {row['rate']:.0%}"
            ax.plot(times, blocks, label=label, linewidth=1)
        title = f"{shared} tokens shared by every prompt" if shared else "prompts of their own"
        ax.set(title=f"{title} (policies at 75%)", xlabel="seconds", ylabel="KV blocks in use")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def needle_prompts(requests: int, prompt_tokens: int, shared: int = 0) -> tuple[list[list[int]], list[tuple[str, ...]]]:
    """The prompts (context then question, as ids) and each one's expected answers; with `shared`, every prompt
    starts with the same `shared` tokens (an instruction: the essays' first words) before its own context."""
    from kvsieve.harness.data.haystack import essay_words
    from kvsieve.harness.data.ruler import ruler_samples
    from kvsieve.harness.data.sample import encode
    from kvsieve.harness.models import load_tokenizer

    tokenizer = load_tokenizer(None)
    samples = ruler_samples("niah_single_2", tokenizer, length=prompt_tokens - shared, n=requests, seed=0)
    encoded = [encode(sample, tokenizer) for sample in samples]
    prefix = tokenizer(" ".join(essay_words()[: 2 * shared])).input_ids[:shared] if shared else []
    prompts = [prefix + e.context_ids[0].tolist() + e.question_ids[0].tolist() for e in encoded]
    return prompts, [sample.answers for sample in samples]


def held_after_compaction(trace: Path) -> dict | None:
    """The blocks a request holds right after its compactions, and the blocks its mean count needs (means)."""
    compacted = [c for line in trace.read_text().splitlines() for c in json.loads(line)["compacted"]]
    if not compacted:
        return None
    return {key: statistics.mean(c[key] for c in compacted) for key in ("blocks", "ideal")}


def serve(job: dict) -> dict:
    """One row, in this process: start the engine, submit every request at once, step until all finish."""
    from vllm import LLM, SamplingParams

    from kvsieve.harness.eval.answers import string_match
    from kvsieve.harness.models import model_folder

    prompts, answers = needle_prompts(job["requests"], job["prompt"], job["shared"])
    extra, trace = dict(job["engine"]), Path(tempfile.mkdtemp()) / "trace.jsonl"
    if job["kvsieve"] is not None:
        extra["additional_config"] = {"kvsieve": job["kvsieve"] | {"trace": str(trace)}}
    longest = max(map(len, prompts)) + job["new"]
    llm = LLM(
        model=str(model_folder(None)), dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.3,
        num_gpu_blocks_override=job["blocks"], max_model_len=-(-longest // BLOCK) * BLOCK, seed=0,
        disable_log_stats=False, **extra,
    )  # fmt: skip
    engine, params = llm.llm_engine, SamplingParams(max_tokens=job["new"], temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    first, done, texts, timeline = {}, {}, {}, []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter() - start
        for out in outputs:
            if out.outputs[0].token_ids:
                first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id], texts[out.request_id] = now, out.outputs[0].text
        metrics = {metric.name: getattr(metric, "value", None) for metric in llm.get_metrics()}
        timeline.append((round(now, 3), metrics[RUNNING], metrics[KV_USAGE], metrics[PREEMPTIONS]))
    elapsed = max(done.values())
    return {
        "elapsed": elapsed,
        "output_tps": job["requests"] * job["new"] / elapsed,
        "total_tps": (sum(map(len, prompts)) + job["requests"] * job["new"]) / elapsed,
        "ttft_median": statistics.median(first.values()),
        "tpot_median": statistics.median((done[r] - first[r]) / (job["new"] - 1) for r in done),
        "most_running": max(int(running) for _, running, _, _ in timeline),
        "preemptions": int(timeline[-1][3]),
        "timeline": [(t, round(usage * (job["blocks"] - 1))) for t, _, usage, _ in timeline],
        "answered": sum(string_match(texts[str(i)], a) == 100.0 for i, a in enumerate(answers)),
        "prompt_tokens": statistics.mean(map(len, prompts)),
        "held_blocks": held_after_compaction(trace) if trace.exists() else None,
    }


def rows(args: argparse.Namespace) -> list[dict]:
    """Every row to run: vLLM, vLLM with room for all, each policy at each rate and the others at 75%; then, with a
    shared instruction, vLLM and each policy at 75 and 90%."""
    full_blocks = -(-(args.prompt + args.new) // BLOCK)
    base = {"new": args.new, "requests": args.requests, "prompt": args.prompt, "blocks": args.blocks, "rate": None}
    base |= {"engine": {}, "kvsieve": None, "shared": 0}
    jobs = [base | {"policy": VLLM}, base | {"policy": ROOMY, "blocks": args.requests * full_blocks + 1}]
    served = [(policy, rate) for policy in args.policies for rate in args.rates]
    served += [(policy, 0.75) for policy in args.also]
    jobs += [base | {"policy": p, "rate": r, "kvsieve": {"policy": p, "rate": r}} for p, r in served]
    if args.shared:
        shared = base | {"shared": args.shared}
        jobs.append(shared | {"policy": VLLM})
        for policy in args.policies:
            jobs += [
                shared | {"policy": policy, "rate": r, "kvsieve": {"policy": policy, "rate": r}} for r in (0.75, 0.9)
            ]
    return jobs


def run_child(job: dict) -> dict:
    """One row in a fresh process; its JSON result."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(job)], capture_output=True, text=True, check=False
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"row {job['policy']} {job['rate']} failed:\n{out.stderr[-4000:]}")
    threads = re.search(r"Reducing Torch threads from \d+ to (\d+)", out.stderr + out.stdout)
    worker_threads = int(threads.group(1)) if threads else None
    return job | json.loads(lines[-1].removeprefix("RESULT ")) | {"torch_threads": worker_threads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=2000)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=72)
    parser.add_argument("--policies", type=lambda s: s.split(","), default=["trimkv+global"])
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 0.75, 0.9])
    parser.add_argument("--also", type=lambda s: s.split(",") if s else [], default=["trimkv+adaptive", "trimkv"])
    parser.add_argument("--shared", type=int, default=1000, help="tokens of the shared instruction (0: no such rows)")
    parser.add_argument("--quick", action="store_true", help="4 requests of 600 tokens (256 shared), 32 new, 16 blocks")
    parser.add_argument("--out", type=TABLE.named, default="vllm_serving")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(serve(json.loads(args.child))), flush=True)
        return
    if args.quick:
        args.requests, args.prompt, args.new, args.blocks, args.rates, args.shared = 4, 600, 32, 16, [0.75], 256
        args.out = "vllm_serving_quick"
    import vllm

    import kvsieve
    from gates_provenance import default_gates

    console, results = Console(), []
    for job in rows(args):
        tick = time.perf_counter()
        result = run_child(job)
        results.append({k: v for k, v in result.items() if k != "kvsieve"})
        console.print(
            f"{job['shared']:>5} shared  {job['policy']:<26} {job['rate'] or '':<5} "
            f"{result['output_tps']:6.1f} out tok/s  "
            f"running {result['most_running']}  preempted {result['preemptions']}  answered {result['answered']}"
            f"  ({time.perf_counter() - tick:.0f} s)"
        )
    setup = {
        "vllm": vllm.__version__, "requests": args.requests, "prompt_tokens": args.prompt, "blocks": args.blocks,
        "new": args.new, "full_requests_fit": (args.blocks - 1) / -(-(args.prompt + args.new) // BLOCK),
        "torch_threads": results[0]["torch_threads"], "cpus": os.cpu_count(),
        "default_gates": default_gates(kvsieve.load_model()[0]),
    }  # fmt: skip
    report = {"setup": setup, "rows": results}
    path = TABLE.write(report, args.out)
    plot(report, RESULTS / f"{args.out}_blocks.png")
    console.print(path.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
