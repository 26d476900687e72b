"""Chunked prefill: a long prompt fed `chunk` tokens at a time at a size budget, against one-shot compression.

The default model reads a `--prompt`-token essay context with `snapkv` at `max_tokens=1024`:
once in one observed prefill compressed afterwards (it holds every entry until then), and
chunked with chunks of 256, 512 and 1024 tokens (evicted back to the budget before each chunk
and after the last). For each: the most entries per (layer, kv-head) the cache held at any
point (averaged over heads), prefill seconds (median of `--repeats`), and the perplexity of the
next 512 tokens from the compressed cache, next to the full cache's.

A policy that scores by the model repeating its prompt (`--policy kvzip+global`) repeats every token fed
so far at each eviction; its peak counts the copy the repetition runs on (held entries, the repeat
instruction and one piece of the prompt).

    python benchmarks/chunked_prefill.py [--prompt 7680] [--max-tokens 1024] [--chunks 256,512,1024] [--policy snapkv]
        [--repeats 3] [--out chunked_prefill]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table
from transformers import PreTrainedTokenizerBase

import kvsieve
from kvsieve.harness.data import long_context
from kvsieve.harness.eval.respond import continuation_nll
from kvsieve.harness.report import markdown_table
from kvsieve.runtime.compat import passed_cache
from results_io import Output

CONTINUATION = 512


class PeakEntries:
    """The most entries per (layer, kv-head) a `SievedCache` holds after any forward (hook on the last layer)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.peak = 0.0
        self.handle = model.base_model.layers[-1].register_forward_hook(self._seen, with_kwargs=True)

    def _seen(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        cache = passed_cache(kwargs)
        if isinstance(cache, kvsieve.SievedCache):
            self.peak = max(self.peak, cache.mean_stored())

    def remove(self) -> None:
        self.handle.remove()


def measure(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    ids: torch.Tensor,
    feed: torch.Tensor,
    args: argparse.Namespace,
    chunk: int | None,
) -> dict:
    peaks, seconds = PeakEntries(model), []
    for _ in range(args.repeats):
        tick = time.perf_counter()
        cache = kvsieve.compress(model, ids, args.policy, max_tokens=args.max_tokens, chunk=chunk, tokenizer=tokenizer)
        seconds.append(time.perf_counter() - tick)
    peaks.remove()
    kv_mib = cache.nbytes() / (1 << 20)
    with kvsieve.sieve_attention(model):
        nll = continuation_nll(model, cache, feed)[0]  # appends the continuation to the cache
    return {
        "chunk": chunk,
        "peak_entries_per_head": peaks.peak,
        "prefill_s": statistics.median(seconds),
        "ppl": math.exp(nll / CONTINUATION),
        "kv_mib": kv_mib,
    }


def markdown(report: dict) -> str:
    """The report as a Markdown table: peak entries, bytes, prefill time and PPL, one-shot against chunked."""
    header = ["prefill", "peak entries per head", "budget + chunk", "KV MiB after"]
    header += [f"prefill s (median of {report['repeats']})", "vs one-shot", f"PPL of the next {report['continuation']}"]
    body = []
    for r in report["rows"]:
        one_shot = r["chunk"] is None
        body.append(
            ["one-shot" if one_shot else f"chunks of {r['chunk']}", f"{r['peak_entries_per_head']:.0f}",
             str(report["prompt"] if one_shot else report["max_tokens"] + r["chunk"]), f"{r['kv_mib']:.1f}",
             f"{r['prefill_s']:.2f}", f"{r['time_vs_one_shot']:.2f}", f"{r['ppl']:.2f}"]
        )  # fmt: skip
    return markdown_table(header, body) + "\n"


TABLE = Output("chunked_prefill*", {"": markdown})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=7680)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--chunks", default="256,512,1024")
    parser.add_argument("--policy", default="snapkv")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--out", default="chunked_prefill", type=TABLE.named, help="results file stem (chunked_prefill*)"
    )
    args = parser.parse_args()
    model, tokenizer = kvsieve.load_model()
    text = long_context(tokenizer, args.prompt + CONTINUATION + 1)
    ids, feed = text[:, : args.prompt], text[:, args.prompt : args.prompt + CONTINUATION + 1]
    full = kvsieve.observe_prefill(model, ids).cache
    with kvsieve.sieve_attention(model):
        full_ppl = math.exp(continuation_nll(model, full, feed)[0] / CONTINUATION)
    rows = [measure(model, tokenizer, ids, feed, args, None)]
    rows += [measure(model, tokenizer, ids, feed, args, int(c)) for c in args.chunks.split(",")]
    one_shot = rows[0]["prefill_s"]
    table = Table(
        "prefill",
        "peak entries / head",
        "budget + chunk",
        "KV MiB after",
        "prefill s",
        "vs one-shot",
        f"PPL next {CONTINUATION}",
        title=f"{args.policy}, max_tokens={args.max_tokens}, {args.prompt}-token prompt, full-cache PPL {full_ppl:.2f}",
    )
    for r in rows:
        r["time_vs_one_shot"] = r["prefill_s"] / one_shot
        bound = args.prompt if r["chunk"] is None else args.max_tokens + r["chunk"]
        table.add_row(
            "one-shot" if r["chunk"] is None else f"chunk {r['chunk']}",
            f"{r['peak_entries_per_head']:.0f}",
            str(bound),
            f"{r['kv_mib']:.1f}",
            f"{r['prefill_s']:.2f}",
            f"{r['time_vs_one_shot']:.2f}",
            f"{r['ppl']:.2f}",
        )
    Console().print(table)
    report = {**vars(args), "continuation": CONTINUATION, "full_cache_ppl": full_ppl, "rows": rows}
    print(f"wrote {TABLE.write(report, args.out)}")


if __name__ == "__main__":
    main()
