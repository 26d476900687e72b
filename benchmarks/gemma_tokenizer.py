"""Gemma-3-270M: which tokenizer, with or without BOS (needs the optional packages, `make gemma`).

The same dequantized model scores the first `--tokens` tokens of `--docs` essays, tokenized by
`transformers`' GGUF converter (a Unigram model of the vocabulary, no BOS) and by the tokenizer
kvsieve rebuilds from the GGUF (`kvsieve.harness.gemma.gguf_spm_tokenizer`: SentencePiece BPE, BOS first),
each with and without BOS in front. Perplexity is per token, so it is comparable only within one
tokenizer; bits per character compare them all.

    python benchmarks/gemma_tokenizer.py [--docs 4] [--tokens 512]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer, PreTrainedTokenizerBase

import kvsieve
from kvsieve.harness.data import essay_texts
from kvsieve.harness.gemma import gemma_gguf
from kvsieve.harness.models import cache_home

RESULTS = Path(__file__).parent / "results"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
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
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gemma_tokenizer.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
