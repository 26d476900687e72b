"""Bounded generation: a cache held at `max_tokens` while the default model generates thousands of tokens.

The default model decodes `--steps` tokens greedily from a short essay prompt: per policy from
a kvsieve cache compressed to `max_tokens` with `buffer` (it is evicted back to the budget every
`buffer` steps), and from the model's own unbounded `DynamicCache`. The caches advance in
lockstep (one step of each in turn), so a busy machine slows them alike. Every `--every` steps we
sample KV bytes held and allocated, the process RSS and the median step time of the last
`--every` steps. Until the first eviction the caches hold the same entries: the first 64 steps'
logits must agree. The policies show the cost per step of what a scorer keeps between evictions:
nothing (knorm), the recent queries (snapkv), attention accumulated online (h2o). Then a soak on
a tiny random model: `--soak-steps` steps, checking that the budget holds, the newest stored
position is the step count and RSS stays flat.

    python benchmarks/bounded_generation.py [--steps 8000] [--max-tokens 512] [--policies knorm,snapkv,h2o]
"""

from __future__ import annotations

import argparse
import statistics
import time

import psutil
import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvsieve
from kvsieve.harness.data import long_context
from kvsieve.harness.report import markdown_table
from kvsieve.runtime.compat import cache_argument
from results_io import Output

MIB = 1 << 20
#: The samples the Markdown table shows (every sample when none of these was taken).
TABLE_STEPS = (500, 1000, 2000, 4000, 6000, 8000)


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / MIB


class Decoder:
    """Greedy decoding from one cache, a step at a time: step times, samples every `every` steps, first 64 logits."""

    def __init__(self, cache: object, first: torch.Tensor, every: int) -> None:
        self.cache, self.token, self.every = cache, first, every
        self.times: list[float] = []
        self.samples: list[dict] = []
        self.early: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, model: torch.nn.Module) -> None:
        tick = time.perf_counter()
        logits = model(input_ids=self.token, **cache_argument(model, self.cache), use_cache=True).logits[:, -1]
        self.times.append(time.perf_counter() - tick)
        self.token = logits.argmax(-1, keepdim=True)
        step = len(self.times)
        if step <= 64:
            self.early.append(logits.clone())
        if step % self.every == 0:
            sieved = isinstance(self.cache, kvsieve.SievedCache)
            held = self.cache.nbytes() if sieved else dense_nbytes(self.cache)
            self.samples.append(
                {
                    "step": step,
                    "kv_mib": held / MIB,
                    "allocated_mib": (self.cache.allocated_nbytes() if sieved else held) / MIB,
                    "rss_mib": rss_mib(),
                    "step_ms": 1e3 * statistics.median(self.times[-self.every :]),
                }
            )


def dense_nbytes(cache: DynamicCache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def default_model_run(args: argparse.Namespace, console: Console) -> dict:
    model, tokenizer = kvsieve.load_model()
    prompt = long_context(tokenizer, args.prompt)[:, : args.prompt]
    first = prompt[:, -1:]
    dense = DynamicCache()
    with torch.no_grad():
        model(input_ids=prompt[:, :-1], **cache_argument(model, dense), use_cache=True)
    unbounded = Decoder(dense, first, args.every)
    policies = args.policies.split(",")
    bounded = {
        policy: Decoder(
            kvsieve.compress(model, prompt[:, :-1], policy, max_tokens=args.max_tokens, buffer=args.buffer),
            first,
            args.every,
        )
        for policy in policies
    }
    with kvsieve.sieve_attention(model):  # the unbounded DynamicCache takes the model's own SDPA path
        for _ in track(range(args.steps), description=f"{len(policies)} bounded caches and the unbounded one"):
            for decoder in (unbounded, *bounded.values()):
                decoder.step(model)
    report = {}
    for policy, decoder in bounded.items():
        early_error = float((torch.stack(decoder.early) - torch.stack(unbounded.early)).abs().max())
        rows = [
            {"step": b["step"], "bounded": b, "unbounded": u, "time_ratio": b["step_ms"] / u["step_ms"]}
            for b, u in zip(decoder.samples, unbounded.samples, strict=True)
        ]
        console.print(samples_table(policy, rows))
        console.print(f"{policy}: first 64 steps, largest logit difference bounded vs unbounded: {early_error:.2e}")
        report[policy] = {"rows": rows, "first_64_max_abs_logit_diff": early_error}
    console.print(cost_table(report, policies[0]))
    return report


def cost_table(report: dict, baseline: str) -> Table:
    """Median step time once the budget is reached (after the first `every` steps), per policy and vs `baseline`."""
    median = {p: statistics.median(r["bounded"]["step_ms"] for r in runs["rows"][1:]) for p, runs in report.items()}
    table = Table("policy", "step ms (median of samples after the first)", f"vs {baseline}", title="cost per step")
    for policy, ms in median.items():
        table.add_row(policy, f"{ms:.1f}", f"{ms / median[baseline]:.2f}")
        report[policy]["step_ms_at_budget"] = ms
    return table


def samples_table(policy: str, rows: list[dict]) -> Table:
    """Bytes, RSS and step time of one bounded cache against the unbounded one, every `every` steps."""
    table = Table(
        "step",
        "bounded KV MiB",
        "allocated MiB",
        "RSS MiB",
        "step ms",
        "unbounded KV MiB",
        "step ms",
        "time ratio",
        title=f"{policy}, bounded vs unbounded",
    )
    for row in rows:
        b, u = row["bounded"], row["unbounded"]
        table.add_row(
            str(row["step"]),
            f"{b['kv_mib']:.2f}",
            f"{b['allocated_mib']:.2f}",
            f"{b['rss_mib']:.0f}",
            f"{b['step_ms']:.1f}",
            f"{u['kv_mib']:.2f}",
            f"{u['step_ms']:.1f}",
            f"{row['time_ratio']:.2f}",
        )
    return table


def markdown(report: dict) -> str:
    """The report as a Markdown table: step times, bytes and RSS of the bounded caches and the unbounded one."""
    policies = report["policies"]
    runs = {p: {r["step"]: r for r in report["default_model"][p]["rows"]} for p in policies}
    steps = [s for s in runs[policies[0]] if s in TABLE_STEPS] or list(runs[policies[0]])
    ratios = list(dict.fromkeys((policies[0], policies[-1])))
    header = [
        "step", *(f"{p} ms" for p in policies), "unbounded ms", *(f"{p} / unbounded" for p in ratios),
        "bounded KV MiB (allocated)", "unbounded KV MiB", "process RSS MiB",
    ]  # fmt: skip
    body = []
    for step in steps:
        first = runs[policies[0]][step]
        held, unbounded = first["bounded"], first["unbounded"]
        body.append(
            [str(step), *(f"{runs[p][step]['bounded']['step_ms']:.1f}" for p in policies),
             f"{unbounded['step_ms']:.1f}", *(f"{runs[p][step]['time_ratio']:.2f}" for p in ratios),
             f"{held['kv_mib']:.2f} ({held['allocated_mib']:.2f})", f"{unbounded['kv_mib']:.2f}",
             f"{held['rss_mib']:.0f}"]
        )  # fmt: skip
    return markdown_table(header, body) + "\n"


TABLE = Output("bounded_generation", {"": markdown})


@torch.no_grad()
def soak(args: argparse.Namespace, console: Console) -> dict:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.soak_steps + 1024,
    )
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (1, 64))
    max_tokens, buffer = 48, 16
    cache = kvsieve.compress(model, ids, args.soak_policy, max_tokens=max_tokens, buffer=buffer)
    token, rss, worst = ids[:, -1:], [], 0.0
    with kvsieve.sieve_attention(model):
        for step in track(range(1, args.soak_steps + 1), description="soak"):
            token = model(input_ids=token, **cache_argument(model, cache), use_cache=True).logits[:, -1:].argmax(-1)
            worst = max(worst, cache.mean_stored())
            if step % 1000 == 0:
                newest = {int(p.max()) for layer in range(2) for p in cache.kept_positions(layer)}
                if newest != {63 + step}:
                    raise AssertionError(f"step {step}: newest stored positions {newest}, expected {63 + step}")
                rss.append(rss_mib())
    if worst > max_tokens + buffer:
        raise AssertionError(f"the cache held {worst} entries per head, budget {max_tokens} + buffer {buffer}")
    console.print(
        f"soak: {args.soak_steps} steps, at most {worst:.1f} entries per head (budget {max_tokens} + {buffer}), "
        f"RSS {rss[0]:.0f} -> {rss[-1]:.0f} MiB (after 1k and {args.soak_steps // 1000}k steps)"
    )
    return {"steps": args.soak_steps, "max_held_per_head": worst, "rss_mib_every_1000": rss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8000)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--buffer", type=int, default=64)
    parser.add_argument("--policies", default="knorm,snapkv,h2o", help="comma-separated policy specs")
    parser.add_argument("--soak-policy", default="knorm")
    parser.add_argument("--soak-steps", type=int, default=100_000)
    args = parser.parse_args()
    console = Console()
    report = {
        "policies": args.policies.split(","),
        "soak_policy": args.soak_policy,
        "max_tokens": args.max_tokens,
        "buffer": args.buffer,
        "steps": args.steps,
    }
    report["default_model"] = default_model_run(args, console)
    report["soak"] = soak(args, console)
    console.print(f"wrote {TABLE.write(report)}")


if __name__ == "__main__":
    main()
