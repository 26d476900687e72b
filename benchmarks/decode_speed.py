"""One decode step with a compressed cache against one with the full cache (default model, CPU).

At each context length: one observed prefill, then caches of the same context: the model's
own full `DynamicCache` (SDPA attention), kvsieve caches at rate 0.8 with the `uniform`,
`adaptive` and `global` allocators, and the `uniform` one with its kept entries in `--kv-bits`
(8- and 4-bit integers, fp8; every forward reads them back quantized: the cost of dequantizing).
Decode steps are interleaved (full, uniform, adaptive, global, ..., full, ...) so drift in machine
load hits all alike; we report the median step time of each and the ratio to the full-cache step,
next to the bound set by bytes read per step:
(weights + kept KV) / (weights + full KV).

    python benchmarks/decode_speed.py [--lengths 2048,4096,8192] [--steps 40]
    python benchmarks/decode_speed.py --device cuda --dtype bfloat16 --random-weights DIR   # on a GPU
"""

from __future__ import annotations

import argparse
import functools
import operator
import statistics
import time

import torch
import transformers
from rich.console import Console
from rich.table import Table
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from kvsieve import SievedCache, load_model, make_policy, observe_prefill, sieve_attention
from kvsieve.harness.data import long_context
from kvsieve.harness.report import markdown_table
from kvsieve.runtime.attention.sieve import attention_implementation
from kvsieve.runtime.compat import cache_argument
from kvsieve.runtime.storage.codecs import codec_for, storage_codec
from kvsieve.selection.storage import Storage
from results_io import Output

ALLOCATORS = ("uniform", "adaptive", "global")


def dynamic_cache_from(cache: SievedCache) -> DynamicCache:
    """The same full cache as a plain transformers `DynamicCache` (every head holds every entry)."""
    dense = DynamicCache()
    for layer_idx, layer in enumerate(cache.layers):
        view = layer.segments.padded()
        dense.update(view.keys.clone(), view.values.clone(), layer_idx)
    return dense


def uniform_storages(widths: str) -> dict[str, Storage]:
    """The quantized uniform caches `--kv-bits` names ("8,4,fp8"), by cache name: a number is `kv_bits` (integer
    codes), a name a `kv_codec` (fp8: float8 e4m3)."""
    out = {}
    for width in filter(None, widths.split(",")):
        storage = Storage(int(width)) if width.isdigit() else Storage(kv_codec=width)
        codec_for(storage)  # an unknown codec fails here, before the model loads
        out[f"uniform, {width}-bit" if width.isdigit() else f"uniform, {width}"] = storage
    return out


def dynamic_nbytes(cache: DynamicCache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def markdown(report: dict) -> str:
    """The report as a Markdown table: step time per context and cache, next to the bytes bound."""
    header = ["context", "cache", "KV MiB", f"step ms (median of {report['steps']})", "ratio vs full"]
    header += ["bytes bound", "ratio / bound"]
    body = [
        [str(r["context"]), r["cache"], f"{r['kv_mib']:.1f}", f"{r['step_ms']:.1f}", f"{r['ratio_vs_full']:.3f}",
         f"{r['bytes_bound']:.3f}", f"{r['ratio_over_bound']:.2f}"]
        for r in report["rows"]
    ]  # fmt: skip
    return markdown_table(header, body) + "\n"


TABLE = Output("decode_speed*", {"": markdown})


@torch.no_grad()
def decode_step(model: torch.nn.Module, cache: object, token: torch.Tensor, device: str) -> float:
    """Seconds for one forward of one token (at its true position: the count of tokens the cache has seen)."""
    synchronize(device)
    tick = time.perf_counter()
    model(input_ids=token, **cache_argument(model, cache), use_cache=True)
    synchronize(device)
    return time.perf_counter() - tick


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--rate", type=float, default=0.8)
    parser.add_argument("--scorer", default="snapkv")
    parser.add_argument(
        "--kv-bits",
        type=uniform_storages,
        default="8,4,fp8",
        help="the quantized uniform caches: bits or fp8 ('' for none)",
    )
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per cache")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--random-weights", metavar="CONFIG_DIR", help="a model folder's config.json: its shape, random weights"
    )
    parser.add_argument(
        "--out", type=TABLE.named, help="results file stem (default decode_speed, or decode_speed_cuda on a GPU)"
    )
    args = parser.parse_args()
    console = Console()
    lengths = [int(x) for x in args.lengths.split(",")]
    dtype, needed = getattr(torch, args.dtype), max(lengths) + args.warmup + args.steps
    if args.random_weights:  # the default model's shape with random weights: the same bytes and calls per step
        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(args.random_weights)
        model = AutoModelForCausalLM.from_config(config).to(device=args.device, dtype=dtype).eval()
        ids = torch.randint(0, config.vocab_size, (1, needed), generator=torch.Generator().manual_seed(0))
    else:
        model, tokenizer = load_model(dtype=dtype)
        ids = long_context(tokenizer, needed)
    model, ids = model.to(args.device), ids.to(args.device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    for length in lengths:
        policies = {allocator: make_policy(args.scorer, allocator=allocator) for allocator in ALLOCATORS}
        needs = functools.reduce(operator.or_, (p.needs for p in policies.values()))
        prefill = observe_prefill(model, ids[:, :length], needs)
        caches: dict[str, object] = {"full": dynamic_cache_from(prefill.cache)}
        for allocator, policy in policies.items():
            caches[allocator] = prefill.cache.keep([policy.select(prefill.observations[0], args.rate)])
        for name, storage in args.kv_bits.items():
            keep = [policies["uniform"].select(prefill.observations[0], args.rate)]
            caches[name] = prefill.cache.keep(keep, codec=storage_codec(storage, model))
        kv_bytes = {name: cache.nbytes() for name, cache in caches.items() if name != "full"}
        kv_bytes["full"] = dynamic_nbytes(caches["full"])
        del prefill
        times: dict[str, list[float]] = {name: [] for name in caches}
        for step in range(args.warmup + args.steps):
            token = ids[:, length + step : length + step + 1]
            for name, cache in caches.items():
                # the full cache runs the model's own SDPA path; ours runs sieve attention
                with attention_implementation(model, "sdpa") if name == "full" else sieve_attention(model):
                    seconds = decode_step(model, cache, token, args.device)
                if step >= args.warmup:
                    times[name].append(seconds)
        full_ms = statistics.median(times["full"]) * 1e3
        for name in caches:
            ms = statistics.median(times[name]) * 1e3
            bound = (weights + kv_bytes[name]) / (weights + kv_bytes["full"])
            rows.append(
                {
                    "context": length,
                    "cache": name,
                    "kv_mib": kv_bytes[name] / 2**20,
                    "step_ms": ms,
                    "ratio_vs_full": ms / full_ms,
                    "bytes_bound": bound,
                    "ratio_over_bound": (ms / full_ms) / bound,
                }
            )
        console.print(f"context {length}: done")
    table = Table(
        "context",
        "cache",
        "KV MiB",
        "step ms (median)",
        "ratio vs full",
        "bytes bound",
        "ratio / bound",
        title=f"decode step, {args.scorer} at rate {args.rate}, {args.steps} steps interleaved, "
        f"{args.device} {args.dtype}",
    )
    for r in rows:
        table.add_row(
            str(r["context"]),
            r["cache"],
            f"{r['kv_mib']:.1f}",
            f"{r['step_ms']:.1f}",
            f"{r['ratio_vs_full']:.3f}",
            f"{r['bytes_bound']:.3f}",
            f"{r['ratio_over_bound']:.2f}",
        )
    console.print(table)
    meta = {
        "model": f"SmolLM2-135M-Instruct (GGUF, dequantized to {args.dtype})"
        + (", random weights of its shape" if args.random_weights else ""),
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "scorer": args.scorer,
        "rate": args.rate,
        "steps": args.steps,
        "weights_bytes": weights,
    }
    stem = args.out or ("decode_speed" if args.device == "cpu" else "decode_speed_cuda")
    console.print(f"wrote {TABLE.write({**meta, 'rows': rows}, stem)}")


if __name__ == "__main__":
    main()
