"""Time per training step and per training token of `kvsieve train-gates`, before and after the fast trainer.

"before" is the trainer of kvsieve 0.1: the decay bias built as a `T x T` float mask per layer (SDPA's
math kernel and its backward), the distillation KL over every position and the whole vocabulary, the
capacity hinge at every step. "after" is the default now: the bias folded into the fused causal kernel
(`decayed_attention`) and the loss terms read at `kl_tokens` positions drawn per step. Both run on the
same training sequences, one step of each in turn, after a warm-up step; medians over the rounds.

    python benchmarks/train_speed.py [--model default] [--seq-len 1024] [--rounds 8] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvsieve.harness.models import DEFAULT_MODEL, load_model
from kvsieve.harness.progress import console
from kvsieve.harness.report import markdown_table
from kvsieve.harness.training.data import training_data
from kvsieve.harness.training.retention import RetentionTape
from kvsieve.harness.training.train import TrainConfig, loss_positions, train_step
from kvsieve.selection.gates import RetentionGates, gate_shape
from kvsieve.selection.rotary import find_rotary

RESULTS = Path(__file__).parent / "results"

#: (label, fused decay bias, kl_tokens)
TRAINERS = (("before (kvsieve 0.1)", False, 0), ("after", True, TrainConfig.kl_tokens))


def step_seconds(model: torch.nn.Module, gates: RetentionGates, ids: torch.Tensor, fused: bool, kl: int) -> float:
    """Seconds of one optimiser step's forward and backward (the optimiser update itself is negligible)."""
    cos, sin = find_rotary(model)(torch.arange(ids.shape[1], device=ids.device))
    tape = RetentionTape(gates, cos, sin, fused=fused)
    config = TrainConfig(seq_len=ids.shape[1], kl_tokens=kl)
    positions = loss_positions(ids.shape[1], kl, torch.Generator().manual_seed(0))
    start = time.perf_counter()
    terms = train_step(model, gates, tape, ids, config, positions)
    torch.autograd.backward(terms["loss"], inputs=list(gates.parameters()))
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(args: argparse.Namespace) -> dict:
    """Median seconds per step of each trainer over `args.rounds` interleaved rounds."""
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    data = training_data(tokenizer, args.seq_len, per_task=0, seed=0)
    sequences = [s for s in data.sequences if s.shape[1] == args.seq_len][: args.rounds + 1]
    gates = RetentionGates(gate_shape(model)).to(args.device)
    times: dict[str, list[float]] = {label: [] for label, _, _ in TRAINERS}
    for round_, ids in enumerate(sequences):
        for label, fused, kl in TRAINERS:
            seconds = step_seconds(model, gates, ids.to(args.device), fused, kl)
            if round_:  # the first round warms up
                times[label].append(seconds)
    rows = []
    for label, _, kl in TRAINERS:
        median = statistics.median(times[label])
        rows.append({"trainer": label, "kl_tokens": kl, "step_s": median, "tokens_per_s": args.seq_len / median})
    base = rows[0]["step_s"]
    for row in rows:
        row["speedup"] = base / row["step_s"]
    name = DEFAULT_MODEL if args.model is None else args.model
    meta = {"model": name, "seq_len": args.seq_len, "rounds": args.rounds, "dtype": args.dtype}
    return meta | {"device": args.device, "threads": torch.get_num_threads(), "rows": rows, "times": times}


def markdown(report: dict) -> str:
    """The table of the report."""
    body = [
        [report["model"], r["trainer"], f"{r['step_s']:.2f}", f"{r['tokens_per_s']:.0f}", f"{r['speedup']:.2f}x"]
        for r in report["rows"]
    ]
    header = ["model", "trainer", f"s per step ({report['seq_len']} tokens, median)", "tokens / s", "speedup"]
    return markdown_table(header, body) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default, gemma3-270m, a path or an HF id")
    parser.add_argument("--seq-len", type=int, default=TrainConfig.seq_len)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    args.model = None if args.model in (None, "default") else args.model
    report = measure(args)
    console.print(markdown(report))
    stem = "train_speed" if args.model is None else f"train_speed_{Path(args.model).name.replace('-', '_')}"
    stem += "" if (args.device, args.dtype) == ("cpu", "float32") else f"_{args.device}_{args.dtype}"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(markdown(report))
    console.print(f"wrote {RESULTS / stem}.json")


if __name__ == "__main__":
    main()
