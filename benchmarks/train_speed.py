"""Time per training step and per training token of `kvsieve train-gates`, before and after the fast trainer.

"before" is the trainer of kvsieve 0.1: the decay bias built as a `T x T` float mask per layer (SDPA's
math kernel and its backward), the distillation KL over every position and the whole vocabulary, the
capacity hinge at every step. "after" is the default now: the bias folded into the fused causal kernel
(`decayed_attention`) and the loss terms read at `kl_tokens` positions drawn per step. A float32 model
gets a third row: "after" with the teacher's forward autocast to bfloat16 (`--teacher-dtype bfloat16`).
All run on the same training sequences, one step of each in turn, after a warm-up step; medians over
the rounds.

    python benchmarks/train_speed.py [--model default] [--seq-len 1024] [--rounds 8] [--dtype float32]
    python benchmarks/train_speed.py --shape llama-3-8b --device cuda --dtype bfloat16

`--shape` builds a random model with a real model's dimensions (and vocabulary size) and trains on random
tokens: the time of a step does not depend on the weights, and no hub is reachable here.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvsieve.harness.models import DEFAULT_MODEL, load_model
from kvsieve.harness.progress import console
from kvsieve.harness.report import markdown_table
from kvsieve.harness.training.data import training_data
from kvsieve.harness.training.retention import RetentionTape
from kvsieve.harness.training.train import TrainConfig, loss_positions, train_step
from kvsieve.modeling.gates import RetentionGates, gate_shape
from kvsieve.modeling.rotary import find_rotary
from results_io import Output, named_for

#: Real models' dimensions for `--shape` (Llama-3.2-1B and Llama-3-8B: hidden, MLP, layers, q heads, kv heads).
SHAPES = {"llama-3.2-1b": (2048, 8192, 16, 32, 8), "llama-3-8b": (4096, 14336, 32, 32, 8)}


class Trainer(NamedTuple):
    """One trainer the benchmark times."""

    label: str
    fused: bool  # the decay bias in the fused causal kernel (else a T x T float mask)
    kl_tokens: int
    teacher_dtype: str | None = None


def trainers(dtype: str) -> list[Trainer]:
    """kvsieve 0.1's trainer, today's, and (for a float32 model) today's with a bfloat16 teacher."""
    rows = [Trainer("before (kvsieve 0.1)", False, 0), Trainer("after", True, TrainConfig.kl_tokens)]
    if dtype == "float32":
        rows.append(Trainer("after, bfloat16 teacher", True, TrainConfig.kl_tokens, "bfloat16"))
    return rows


def step_seconds(model: torch.nn.Module, gates: RetentionGates, ids: torch.Tensor, trainer: Trainer) -> float:
    """Seconds of one optimiser step's forward and backward (the optimiser update itself is negligible)."""
    cos, sin = find_rotary(model)(torch.arange(ids.shape[1], device=ids.device))
    tape = RetentionTape(gates, cos, sin, fused=trainer.fused)
    kl = trainer.kl_tokens
    config = TrainConfig(seq_len=ids.shape[1], kl_tokens=kl, teacher_dtype=trainer.teacher_dtype)
    positions = loss_positions(ids.shape[1], kl, torch.Generator().manual_seed(0))
    start = time.perf_counter()
    terms = train_step(model, gates, tape, ids, config, positions)
    torch.autograd.backward(terms["loss"], inputs=list(gates.parameters()))
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def random_llama(shape: str, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    """A Llama with the named model's dimensions and random weights, built in `dtype` on `device`."""
    hidden, mlp, layers, heads, kv_heads = SHAPES[shape]
    config = LlamaConfig(
        vocab_size=128_256,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=8192,
        rope_theta=500_000.0,
        attn_implementation="sdpa",
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)


def model_and_sequences(args: argparse.Namespace) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """The model and `rounds + 1` training sequences of `seq_len` tokens (random ones for a `--shape`)."""
    dtype = getattr(torch, args.dtype)
    if args.shape:
        model = random_llama(args.shape, dtype, args.device)
        gen = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        return model, [torch.randint(0, vocab, (1, args.seq_len), generator=gen) for _ in range(args.rounds + 1)]
    model, tokenizer = load_model(args.model, dtype=dtype, device=args.device)
    data = training_data(tokenizer, args.seq_len, per_task=0, seed=0)
    return model, [s for s in data.sequences if s.shape[1] == args.seq_len][: args.rounds + 1]


def peak_gib(device: str) -> float | None:
    """The most memory the device held since the last reset (CUDA only), in GiB."""
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def measure(args: argparse.Namespace) -> dict:
    """Median seconds per step of each trainer over `args.rounds` interleaved rounds (and its peak GPU memory)."""
    model, sequences = model_and_sequences(args)
    gates = RetentionGates(gate_shape(model)).to(args.device)
    cuda = args.device.startswith("cuda")
    timed = trainers(args.dtype)
    times: dict[str, list[float]] = {trainer.label: [] for trainer in timed}
    peaks: dict[str, float] = {}
    out_of_memory: set[str] = set()
    for round_, ids in enumerate(sequences):
        for trainer in timed:
            label = trainer.label
            if label in out_of_memory:
                continue
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                seconds = step_seconds(model, gates, ids.to(args.device), trainer)
            except torch.OutOfMemoryError:
                out_of_memory.add(label)
                continue
            if cuda:
                peaks[label] = max(peaks.get(label, 0.0), torch.cuda.max_memory_allocated() / 2**30)
            if round_:  # the first round warms up
                times[label].append(seconds)
    rows = []
    for label, _, kl, teacher in timed:
        median = statistics.median(times[label]) if times[label] else float("nan")
        row = {"trainer": label, "kl_tokens": kl, "teacher_dtype": teacher}
        row |= {"step_s": median, "tokens_per_s": args.seq_len / median}
        rows.append(row | {"peak_gib": peaks.get(label), "out_of_memory": label in out_of_memory})
    for row in rows:
        row["speedup"] = rows[0]["step_s"] / row["step_s"]
    name = f"{args.shape} (random)" if args.shape else DEFAULT_MODEL if args.model is None else args.model
    meta = {"model": name, "seq_len": args.seq_len, "rounds": args.rounds, "dtype": args.dtype}
    meta |= {"device": torch.cuda.get_device_name() if cuda else "cpu", "threads": torch.get_num_threads()}
    return meta | {"rows": rows, "times": times}


def markdown(report: dict) -> str:
    """The table of the report (with the peak GPU memory of each trainer on a GPU)."""
    gpu = report["device"] != "cpu"
    body = []
    for r in report["rows"]:
        speedup = f"{r['speedup']:.2f}x" if math.isfinite(r["speedup"]) else ""
        speed = [f"{r['step_s']:.2f}", f"{r['tokens_per_s']:.0f}", speedup]
        if r["out_of_memory"]:
            speed = ["out of memory", "", ""]
        memory = [f"{r['peak_gib']:.1f}" if r["peak_gib"] else "> GPU"] if gpu else []
        body.append([report["model"], f"{report['device']}, {report['dtype']}", r["trainer"], *speed, *memory])
    header = ["model", "device", "trainer", f"s per step ({report['seq_len']} tokens, median)", "tokens / s"]
    header += ["speedup", *(["peak GiB"] if gpu else [])]
    return markdown_table(header, body) + "\n"


#: train_speed[_<model>][_<device>_<dtype>][_<seq_len>]: the parts that differ from the default run.
TABLE = Output("train_speed*", {"": markdown})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default, gemma3-270m, a path or an HF id")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a random model of these dimensions")
    parser.add_argument("--seq-len", type=int, default=TrainConfig.seq_len)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    args.model = None if args.model in (None, "default") else args.model
    report = measure(args)
    console.print(markdown(report))
    model = args.shape or (args.model and Path(args.model).name)
    stem = named_for("train_speed", model)
    stem += "" if (args.device, args.dtype) == ("cpu", "float32") else f"_{args.device}_{args.dtype}"
    stem += "" if args.seq_len == TrainConfig.seq_len else f"_{args.seq_len}"
    console.print(f"wrote {TABLE.write(report, stem)}")


if __name__ == "__main__":
    main()
