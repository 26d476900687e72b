"""Which tokens of a needle survive: the answer's first token, its other tokens, and the rest of the sentence.

An unseen needle format (`--task`, default `niah_ledger`: "The ledger lists account KEY with a closing
balance of VALUE."), the gate ablation's samples (`--samples`, `--length` tokens, seed 0, so the same
samples as `needle_depth.py`'s and `gate_ablation.py`'s rows), compressed question-agnostic by each
policy at each rate. Per policy and rate, over the samples: how often the answer's first token is still
stored by at least one full-attention (layer, kv-head), the mean share of its other tokens stored there,
how often one full-attention layer stores the whole answer, and the mean share of the rest of the
needle sentence each (layer, kv-head) stores. Tokens as the model's tokenizer splits them (Gemma's
splits numbers into digits). Eviction alone: no answer is generated (`needle_depth.py` has the answers).

    python benchmarks/needle_tokens.py [--model gemma3-270m] [--task niah_ledger] [--policies "trimkv+global"]
        [--rates 0.5,0.75,0.9] [--samples 30]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
from rich.console import Console

import kvsieve
from kvsieve import load_model
from kvsieve.harness.data.sample import EncodedSample, encode
from kvsieve.harness.data.suites import task_samples
from kvsieve.harness.models import GEMMA_MODEL
from kvsieve.harness.progress import progress_bar
from kvsieve.harness.report import markdown_table
from policy_args import policy_list
from results_io import Output, named_for


def answer_positions(encoded: EncodedSample, tokenizer) -> tuple[list[int], list[int]]:
    """Token positions of the asked needle's answer in the context (its whitespace-only tokens left out), and of
    the rest of its sentence."""
    sample = encoded.sample
    (start, end), answer = sample.evidence[0], sample.gold
    at = sample.context.index(answer, start, end)
    answer_only = encode(dataclasses.replace(sample, evidence=((at, at + len(answer)),)), tokenizer)
    ids = encoded.context_ids[0]
    value = [p for p in answer_only.evidence_positions.tolist() if tokenizer.decode(ids[p]).strip()]
    return value, sorted(set(encoded.evidence_positions.tolist()) - set(value))


def kept_by_layer(cache: kvsieve.SievedCache) -> list[list[set[int]]]:
    """The positions each kv-head of each full-attention layer stores."""
    return [[set(positions.tolist()) for positions in cache.kept_positions(idx)] for idx in cache.full_layers]


def survival(layers: list[list[set[int]]], value: list[int], rest: list[int]) -> dict:
    """What of one needle the heads store: the answer's first token anywhere, its other tokens anywhere (share),
    the whole answer in one layer, the rest of the sentence (mean share over heads)."""
    heads = [head for layer in layers for head in layer]
    anywhere = set().union(*heads)
    return {
        "first": value[0] in anywhere,
        "others": sum(p in anywhere for p in value[1:]) / max(len(value) - 1, 1),
        "whole": any(set(value) <= set().union(*layer) for layer in layers),
        "rest": statistics.mean(sum(p in head for p in rest) / len(rest) for head in heads),
    }


def markdown(report: dict) -> str:
    """One row per policy and rate: the four shares, over the samples."""
    header = [
        "policy", "eviction", "answer's first token stored", "answer's other tokens stored",
        "whole answer in one layer", "rest of the sentence stored",
    ]  # fmt: skip
    body = [
        [row["policy"], f"{row['rate']:.0%}", f"{row['first']:.2f}", f"{row['others']:.2f}", f"{row['whole']:.2f}",
         f"{row['rest']:.2f}"]
        for row in report["rows"]
    ]  # fmt: skip
    note = (
        f"\n{report['task']}, {report['samples']} samples at {report['length']} tokens, {report['model']}, "
        "question-agnostic. Stored: by at least one full-attention (layer, kv-head), share of samples (first "
        "token, whole answer) or of tokens (others); the rest of the sentence: mean share over (layer, kv-head).\n"
    )
    return markdown_table(header, body) + note


TABLE = Output("needle_tokens*", {"": markdown})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=GEMMA_MODEL)
    parser.add_argument("--task", default="niah_ledger")
    parser.add_argument("--policies", default="trimkv+global", help="semicolon-separated kvsieve specs")
    parser.add_argument("--rates", default="0.5,0.75,0.9")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--length", type=int, default=1536)
    args = parser.parse_args()
    policies = policy_list(parser, args.policies)
    rates = [float(rate) for rate in args.rates.split(",")]
    model, tokenizer = load_model(args.model)
    samples = task_samples([args.task], tokenizer, length=args.length, n=args.samples, seed=0)
    found: dict[tuple[str, float], list[dict]] = {(policy, rate): [] for policy in policies for rate in rates}
    with progress_bar("needle tokens, compressions") as progress, torch.no_grad():
        for done, sample in enumerate(samples):
            encoded = encode(sample, tokenizer)
            value, rest = answer_positions(encoded, tokenizer)
            for (policy, rate), rows in found.items():
                cache = kvsieve.compress(model, encoded.context_ids, policy, rate=rate, tokenizer=tokenizer)
                rows.append(survival(kept_by_layer(cache), value, rest))
            progress(done + 1, len(samples))
    report = {"model": args.model, "task": args.task, "samples": args.samples, "length": args.length, "rows": []}
    for (policy, rate), rows in found.items():
        means = {key: statistics.mean(float(row[key]) for row in rows) for key in rows[0]}
        report["rows"].append({"policy": policy, "rate": rate} | means)
    Console().print(markdown(report))
    stem = named_for("needle_tokens", args.model) + f"_{args.task}"
    print(f"wrote {TABLE.write(report, stem)}")


if __name__ == "__main__":
    main()
