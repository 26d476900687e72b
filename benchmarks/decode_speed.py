"""One decode step with a compressed cache against one with the full cache (default model, CPU).

At each context length: one observed prefill, then three caches of the same context: the
model's own full `DynamicCache` (SDPA attention) and kvsieve caches at rate 0.8 with the
`uniform` and `adaptive` allocators. Decode steps of the three are interleaved (full,
uniform, adaptive, full, ...) so drift in machine load hits all three alike; we report the
median step time of each and the ratio to the full-cache step, next to the bound set by
bytes read per step: (weights + kept KV) / (weights + full KV).

    python benchmarks/decode_speed.py [--lengths 2048,4096,8192] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import DynamicCache

from kvsieve import SievedCache, load_model, make_policy, observe_prefill
from kvsieve.data import long_context

RESULTS = Path(__file__).parent / "results"


def dynamic_cache_from(cache: SievedCache) -> DynamicCache:
    """The same full cache as a plain transformers `DynamicCache` (every head holds every entry)."""
    dense = DynamicCache()
    for layer_idx, layer in enumerate(cache.layers):
        keys = torch.stack([k[0] for k in layer.head_keys])[None]
        values = torch.stack([v[0] for v in layer.head_values])[None]
        dense.update(keys.clone(), values.clone(), layer_idx)
    return dense


def dynamic_nbytes(cache: DynamicCache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@torch.no_grad()
def decode_step(model: torch.nn.Module, cache: object, token: torch.Tensor) -> float:
    """Seconds for one forward of one token at its true position."""
    position = torch.tensor([cache.get_seq_length()])
    tick = time.perf_counter()
    model(input_ids=token, past_key_values=cache, cache_position=position, use_cache=True)
    return time.perf_counter() - tick


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--rate", type=float, default=0.8)
    parser.add_argument("--scorer", default="snapkv")
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per cache")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    console = Console()
    lengths = [int(x) for x in args.lengths.split(",")]
    model, tokenizer = load_model()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = long_context(tokenizer, max(lengths) + args.warmup + args.steps)
    rows = []
    for length in lengths:
        prefill = observe_prefill(model, ids[:, :length], accumulate=False)
        caches: dict[str, object] = {"full": dynamic_cache_from(prefill.cache)}
        for allocator in ("uniform", "adaptive"):
            policy = make_policy(args.scorer, budget=allocator)
            caches[allocator] = prefill.cache.keep(policy.keep_indices(prefill.observations, args.rate))
        kv_bytes = {"full": dynamic_nbytes(caches["full"])} | {
            name: caches[name].nbytes() for name in ("uniform", "adaptive")
        }
        del prefill
        times: dict[str, list[float]] = {name: [] for name in caches}
        for step in range(args.warmup + args.steps):
            token = ids[:, length + step : length + step + 1]
            for name, cache in caches.items():
                # the full cache runs the model's own SDPA path; ours runs sieve attention
                model.set_attn_implementation("sdpa" if name == "full" else "sieve")
                seconds = decode_step(model, cache, token)
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
        title=f"decode step, {args.scorer} at rate {args.rate}, {args.steps} steps interleaved, CPU float32",
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
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "model": "SmolLM2-135M-Instruct (GGUF, dequantized to float32)",
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "scorer": args.scorer,
        "rate": args.rate,
        "steps": args.steps,
        "weights_bytes": weights,
    }
    (RESULTS / "decode_speed.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    console.print(f"wrote {RESULTS / 'decode_speed.json'}")


if __name__ == "__main__":
    main()
