"""Which layout quantized entries use: kvsieve's per-entry groups against KIVI's per-channel keys (arXiv 2402.02750).

The perplexity protocol (docs/protocols.md) on held-back essays with nothing evicted: the 1,024-token prefix
is prefilled in full precision, its keys and values are replaced by what a quantized cache would
read back, and the next 512 tokens are scored through that cache. Both layouts keep one scale and
one minimum per group of 32 numbers (the same bytes):

- per entry (kvsieve's `Quantized` codec): every key and every value in groups of 32 channels;
- KIVI: keys per channel in groups of 32 tokens (the last, partial group left in full precision,
  as KIVI's residual), values per entry as above.

Then kvsieve's real cache (`compress(..., rate=0, kv_bits=b, kv_residual=R)`): the 512 scored
tokens are fed 64 at a time, as a stream is, and stored quantized as they age out of the residual
of the newest R entries per (layer, kv-head), which stay in full precision.

    python benchmarks/kv_quant_layouts.py [--docs 4]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache

import kvsieve
from kvsieve.harness.data import essay_split, sample_documents
from kvsieve.harness.progress import console
from kvsieve.harness.report import markdown_table
from kvsieve.runtime.compat import cache_argument
from kvsieve.runtime.storage.codecs import Quantized
from results_io import Output

PREFIX, CONTINUATION, GROUP, CHUNK = 1024, 512, 32, 64
RESIDUALS = (0, 32, 128)

#: keys `[b, h, t, d]`, values -> what the cache reads back
Layout = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def per_entry(bits: int) -> Layout:
    codec = Quantized(bits, GROUP)
    return lambda keys, values: codec.decode(codec.encode(keys, values), keys.dtype)


def kivi(bits: int) -> Layout:
    """Keys per channel over groups of 32 tokens (min-max, asymmetric), the last partial group unquantized."""
    codec = Quantized(bits, GROUP)

    def layout(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full = keys.shape[2] // GROUP * GROUP
        by_channel = keys[:, :, :full].transpose(2, 3)  # [b, h, d, tokens]: groups of tokens per channel
        read, _ = codec.decode(codec.encode(by_channel, by_channel), keys.dtype)
        out = keys.clone()
        out[:, :, :full] = read.transpose(2, 3)
        return out, codec.decode(codec.encode(values, values), values.dtype)[1]

    return layout


@torch.no_grad()
def nll_with(model: torch.nn.Module, ids: torch.Tensor, layout: Layout | None) -> float:
    cache = DynamicCache(config=model.config)
    model(ids[:, :PREFIX], **cache_argument(model, cache))
    if layout is not None:
        for layer in cache.layers:
            layer.keys, layer.values = layout(layer.keys, layer.values)
    logits = model(ids[:, PREFIX : PREFIX + CONTINUATION], **cache_argument(model, cache)).logits[0]
    return float(F.cross_entropy(logits.float(), ids[0, PREFIX + 1 : PREFIX + CONTINUATION + 1], reduction="sum"))


@torch.no_grad()
def nll_kvsieve(model: torch.nn.Module, ids: torch.Tensor, bits: int, residual: int) -> float:
    """The continuation fed `CHUNK` tokens at a time through kvsieve's cache (16 bits: full precision)."""
    storage = {} if bits == 16 else {"kv_bits": bits, "kv_residual": residual}
    cache = kvsieve.compress(model, ids[:, :PREFIX], "streaming", rate=0.0, **storage)
    with kvsieve.sieve_attention(model):
        chunks = range(PREFIX, PREFIX + CONTINUATION, CHUNK)
        logits = torch.cat([model(ids[:, s : s + CHUNK], **cache_argument(model, cache)).logits[0] for s in chunks])
    return float(F.cross_entropy(logits.float(), ids[0, PREFIX + 1 : PREFIX + CONTINUATION + 1], reduction="sum"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=4)
    args = parser.parse_args()
    model, tokenizer = kvsieve.load_model()
    documents = sample_documents(tokenizer, args.docs, PREFIX + CONTINUATION + 1, names=essay_split()[1])
    tokens = args.docs * CONTINUATION

    def ppl(score: Callable[[torch.Tensor], float]) -> float:
        return math.exp(sum(score(ids) for _, ids in documents) / tokens)

    full = ppl(lambda ids: nll_with(model, ids, None))
    layouts = []
    for bits in (8, 4, 2):
        for name, layout in (("per entry (kvsieve)", per_entry(bits)), ("keys per channel (KIVI)", kivi(bits))):
            value = ppl(lambda ids, lay=layout: nll_with(model, ids, lay))
            layouts.append({"bits": bits, "layout": name, "ppl": value, "delta_pct": 100 * (value / full - 1)})
            console.print(f"{bits} bits, {name}: PPL {value:.3f} ({layouts[-1]['delta_pct']:+.2f}%)")
    streamed = ppl(lambda ids: nll_kvsieve(model, ids, 16, 0))
    cache = []
    for bits in (8, 4, 2):
        for residual in RESIDUALS:
            value = ppl(lambda ids, b=bits, r=residual: nll_kvsieve(model, ids, b, r))
            cache.append({"bits": bits, "residual": residual, "ppl": value, "delta_pct": 100 * (value / streamed - 1)})
            console.print(f"{bits} bits, residual {residual}: PPL {value:.3f} ({cache[-1]['delta_pct']:+.2f}%)")
    report = {"docs": args.docs, "prefix": PREFIX, "continuation": CONTINUATION, "group": GROUP, "chunk": CHUNK}
    report |= {"full_ppl": full, "full_ppl_chunked": streamed, "layouts": layouts, "cache": cache}
    console.print(markdown(report))
    TABLE.write(report)


def markdown(report: dict) -> str:
    """The two tables: PPL per width and layout after a prefill; then kvsieve's cache per width and residual."""
    body = [[str(r["bits"]), r["layout"], f"{r['ppl']:.3f}", f"{r['delta_pct']:+.2f}%"] for r in report["layouts"]]
    text = markdown_table(["bits", "layout", "PPL", "change"], body) + (
        f"\nfull-cache PPL {report['full_ppl']:.3f}; {report['docs']} held-back essays, prefix {report['prefix']} "
        f"quantized after a full-precision prefill, {report['continuation']} scored tokens as computed; one scale and "
        f"one minimum per {report['group']} numbers in every layout\n\n"
    )
    cache = report["cache"]
    header = ["bits", *(f"residual {residual}" for residual in dict.fromkeys(r["residual"] for r in cache))]
    widths = dict.fromkeys(r["bits"] for r in cache)
    body = [[str(bits), *(f"{r['delta_pct']:+.2f}%" for r in cache if r["bits"] == bits)] for bits in widths]
    text += markdown_table(header, body)
    return text + (
        f"\nkvsieve's cache, nothing evicted: the {report['continuation']} scored tokens fed {report['chunk']} at a "
        f"time and stored as they come (full cache fed the same way: PPL {report['full_ppl_chunked']:.3f}); "
        "residual = the newest entries per (layer, kv-head) kept in full precision\n"
    )


TABLE = Output("kv_quant_layouts", {"": markdown})


if __name__ == "__main__":
    main()
