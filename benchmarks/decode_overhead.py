"""Per-step overhead of a compressed cache on a model shaped like Llama-3-8B, where per-call costs dominate.

A random Llama with Llama-3-8B's structure (32 layers, 32 query heads, 8 kv-heads) and tiny
widths (head_dim 8, hidden 256), so one decode step is made of many small calls, as on a GPU.
For each context length and batch size: one observed prefill, then the model's own full
`DynamicCache` (SDPA) and kvsieve caches compressed at rate 0.8 with `snapkv` and the `uniform`,
`adaptive` and `global` allocators, and the `uniform` one with its kept entries in `--kv-bits`
(8- and 4-bit integers, fp8).
Decode steps of all caches are interleaved (full, uniform, adaptive, global, ..., full, ...) so
drift in machine load hits them alike; we report the median step of each and its ratio to the
full-cache step.

    python benchmarks/decode_overhead.py [--contexts 1024,4096] [--batches 1,4] [--steps 30]
    python benchmarks/decode_overhead.py --device cuda --dtype bfloat16   # on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvsieve
from decode_speed import uniform_storages
from kvsieve.harness.report import markdown_table
from kvsieve.runtime.attention.sieve import attention_implementation
from kvsieve.runtime.compat import cache_argument
from kvsieve.runtime.observing.prefill import Prefill
from kvsieve.runtime.storage.codecs import FULL_PRECISION, EntryCodec, storage_codec
from results_io import Output

ALLOCATORS = ("uniform", "adaptive", "global")


def llama3_8b_shaped(dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def dense_copy(prefill: Prefill) -> DynamicCache:
    """The prefill's full cache as a plain transformers `DynamicCache`."""
    dense = DynamicCache()
    for layer_idx, layer in enumerate(prefill.cache.layers):
        view = layer.segments.padded()
        dense.update(view.keys.clone(), view.values.clone(), layer_idx)
    return dense


def compressed(
    prefill: Prefill, allocator: str, rate: float, codec: EntryCodec = FULL_PRECISION
) -> kvsieve.SievedCache:
    policy = kvsieve.make_policy("snapkv", allocator=allocator)
    keep = [prefill.stored(row, policy.select(obs, rate)) for row, obs in enumerate(prefill.observations)]
    return prefill.cache.keep(keep, codec=codec)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def step_seconds(model: LlamaForCausalLM, cache: object, token: torch.Tensor, device: str) -> float:
    synchronize(device)
    tick = time.perf_counter()
    model(input_ids=token, **cache_argument(model, cache), use_cache=True)
    synchronize(device)
    return time.perf_counter() - tick


def measure(model: LlamaForCausalLM, context: int, batch: int, args: argparse.Namespace) -> list[dict]:
    length = context + args.warmup + args.steps
    ids = torch.randint(0, 1024, (batch, length), generator=torch.Generator().manual_seed(1)).to(args.device)
    prefill = kvsieve.observe_prefill(model, ids[:, :context], kvsieve.Needs(window=32))
    caches: dict[str, object] = {"full": dense_copy(prefill)}
    caches |= {name: compressed(prefill, name, args.rate) for name in ALLOCATORS}
    for name, storage in args.kv_bits.items():
        caches[name] = compressed(prefill, "uniform", args.rate, storage_codec(storage, model))
    kv_bytes = {name: cache.nbytes() for name, cache in caches.items() if name != "full"}
    kv_bytes["full"] = prefill.cache.nbytes()
    del prefill
    times: dict[str, list[float]] = {name: [] for name in caches}
    for step in range(args.warmup + args.steps):
        token = ids[:, context + step : context + step + 1]
        for name, cache in caches.items():
            scope = attention_implementation(model, "sdpa") if name == "full" else kvsieve.sieve_attention(model)
            with scope:
                seconds = step_seconds(model, cache, token, args.device)
            if step >= args.warmup:
                times[name].append(seconds)
    full_ms = statistics.median(times["full"]) * 1e3
    return [
        {
            "context": context,
            "batch": batch,
            "cache": name,
            "kv_mib": kv_bytes[name] / 2**20,
            "step_ms": statistics.median(times[name]) * 1e3,
            "ratio_vs_full": statistics.median(times[name]) * 1e3 / full_ms,
        }
        for name in caches
    ]


def markdown(report: dict) -> str:
    """The report as a Markdown table: step time per context, batch and cache, and its ratio to the full cache."""
    header = ["context", "batch", "cache", "KV MiB", f"step ms (median of {report['steps']})", "ratio vs full"]
    body = [
        [str(r["context"]), str(r["batch"]), r["cache"], f"{r['kv_mib']:.2f}", f"{r['step_ms']:.2f}",
         f"{r['ratio_vs_full']:.3f}"]
        for r in report["rows"]
    ]  # fmt: skip
    return markdown_table(header, body) + "\n"


TABLE = Output("decode_overhead*", {"": markdown})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--rate", type=float, default=0.8)
    parser.add_argument(
        "--kv-bits",
        type=uniform_storages,
        default="8,4,fp8",
        help="the quantized uniform caches: bits or fp8 ('' for none)",
    )
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per cache")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=TABLE.named, help="results file stem (default decode_overhead[_<device>])")
    args = parser.parse_args()
    console = Console()
    model = llama3_8b_shaped(getattr(torch, args.dtype), args.device)
    rows = []
    for context in (int(x) for x in args.contexts.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            rows += measure(model, context, batch, args)
            console.print(f"context {context}, batch {batch}: done")
    table = Table(
        "context",
        "batch",
        "cache",
        "KV MiB",
        "step ms (median)",
        "ratio vs full",
        title=f"decode step, Llama-3-8B-shaped (32 layers, 32 q / 8 kv heads, head_dim 8), snapkv at rate "
        f"{args.rate}, {args.steps} steps interleaved, {args.device} {args.dtype}",
    )
    for r in rows:
        table.add_row(
            str(r["context"]),
            str(r["batch"]),
            r["cache"],
            f"{r['kv_mib']:.2f}",
            f"{r['step_ms']:.2f}",
            f"{r['ratio_vs_full']:.3f}",
        )
    console.print(table)
    meta = {
        "model": "random Llama, 32 layers, 32 q heads, 8 kv-heads, hidden 256, head_dim 8, intermediate 512",
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "rate": args.rate,
        "steps": args.steps,
        "torch": torch.__version__,
    }
    stem = args.out or "decode_overhead" + ("" if args.device == "cpu" else f"_{args.device.split(':')[0]}")
    console.print(f"wrote {TABLE.write({**meta, 'rows': rows}, stem)}")


if __name__ == "__main__":
    main()
