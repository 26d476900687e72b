"""Train retention gates on a frozen model: soft retention, distillation from the full cache, the capacity hinge.

Each step feeds one sequence twice: once with the model's own attention (the teacher: the full
cache), once under soft retention (the student). Loss = quality (forward KL to the teacher, averaged
with the next-token loss if asked) + `lam` x capacity hinge (`kvsieve.harness.training.losses`). With
``target="kvzip"`` the teacher is KVzip's keep decision instead (`kvsieve.harness.training.kvzip_target`:
the model runs forward only). Only the gates receive gradients; the model is not modified. Progress is
saved every `save_every` steps, and a rerun with the same arguments resumes from there; with the same
seed, a run is repeatable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ...modeling.fingerprint import model_fingerprint
from ...modeling.gates import DEFAULT_BIAS_INIT, DEFAULT_WIDTH, RetentionGates, gate_shape
from ...modeling.rotary import find_rotary
from ...selection.checkpoint import TrainRecord, save_gates
from ..progress import progress_bar
from .data import TrainingData, training_data
from .kvzip_target import kvzip_step
from .losses import SCOPES, capacity_loss, forward_kl, next_token_loss
from .retention import RetentionTape, soft_retention

STATE_FILE = "train_state.pt"
TEACHER_DTYPES = (None, "bfloat16", "float16")
#: What the gates learn: the full cache's next-token distribution (KL), or KVzip's keep decision at the capacity.
TARGETS = ("kl", "kvzip")


@dataclass(frozen=True)
class TrainConfig:
    """What `train_gates` does; all of it is recorded with the gates.

    Attributes:
        capacity: `M`, entries per (layer, kv-head) the capacity hinge aims for.
        steps: optimiser steps (one sequence each). The shipped gates of the default model: 160 steps in 1,083 s
            on 2 CPU cores (about 6.7 s a step at 1,024 tokens; `benchmarks/train_speed.py`).
        seq_len: tokens per training sequence.
        lam: weight of the capacity hinge.
        scope: ``"global"`` (one capacity over every layer and head, DBTrimKV) or ``"head"`` (TRIM-KV).
        ntp: average the next-token loss into the quality term.
        lr: Adam learning rate.
        width: hidden units per (layer, kv-head).
        bias_init: initial bias of the shared scoring projection.
        per_task: training samples of every task.
        kl_tokens: positions of each sequence the loss terms read, drawn uniformly at every step (0: all).
            The mean KL over them is an unbiased estimate of the mean over all positions; the teacher's and
            the student's output heads run on them alone (the vocabulary projection is 21% of the default
            model's forward, 62% of Gemma-3-270M's), and the capacity hinge is read at the same steps.
        teacher_dtype: run the teacher's forward under autocast to this dtype (None: the model's own). Its
            logits are the KL's targets only, so their rounding is noise next to the sampled positions; with
            ``"bfloat16"`` a float32 step of the default model takes a third less time on CPUs with bfloat16
            units (`benchmarks/train_speed.py --teacher-bfloat16`; quality: `benchmarks/gates_quality.py`).
        seed: fixes the gates' initialisation, the data order and the drawn positions.
        save_every: steps between resumable saves.
        target: ``"kl"`` (distil the full cache through soft retention) or ``"kvzip"`` (predict KVzip's keep
            decision at `capacity`, Fast KVzip's target, arXiv 2601.17668; `lam`, `scope`, `ntp`, `kl_tokens`
            and `teacher_dtype` do not apply).
    """

    capacity: int = 128
    steps: int = 160
    seq_len: int = 1024
    lam: float = 1.0
    scope: str = "global"
    ntp: bool = False
    lr: float = 5e-3
    width: int = DEFAULT_WIDTH
    bias_init: float = DEFAULT_BIAS_INIT
    per_task: int = 3
    kl_tokens: int = 256
    teacher_dtype: str | None = None
    seed: int = 0
    save_every: int = 25
    target: str = "kl"

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")
        if self.teacher_dtype not in TEACHER_DTYPES:
            raise ValueError(f"teacher_dtype must be one of {TEACHER_DTYPES}, got {self.teacher_dtype!r}")
        if self.kl_tokens < 0:
            raise ValueError(f"kl_tokens must be >= 0, got {self.kl_tokens}")
        for name in ("capacity", "steps", "seq_len", "width", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.capacity >= self.seq_len:
            raise ValueError(f"capacity {self.capacity} must be below seq_len {self.seq_len}: nothing would be evicted")


def loss_positions(length: int, count: int, generator: torch.Generator) -> torch.Tensor | None:
    """`count` distinct positions of a `length`-token sequence, sorted, drawn uniformly (None: all of them)."""
    if count == 0 or count >= length:
        return None
    return torch.randperm(length, generator=generator)[:count].sort().values


def teacher_precision(dtype: str | None, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast to `dtype` on `device` for the teacher's forward (a no-op context for None)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


def train_step(
    model: PreTrainedModel,
    gates: RetentionGates,
    tape: RetentionTape,
    ids: torch.Tensor,
    config: TrainConfig,
    positions: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """One sequence: the teacher's logits, the student's under soft retention, and the loss terms (graph kept).

    `positions`: the steps the loss terms read (None: every position).
    """
    keep = 0 if positions is None else positions.to(ids.device)  # transformers' logits_to_keep: 0 keeps all
    with torch.no_grad(), teacher_precision(config.teacher_dtype, ids.device):
        teacher = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits
    tape.log_beta.clear()
    with soft_retention(model, tape):
        student = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits
    kl = forward_kl(student, teacher)
    quality = (kl + next_token_loss(student, ids, positions)) / 2 if config.ntp else kl
    capacity = capacity_loss(tape.log_beta.values(), config.capacity, config.scope, positions)
    return {"loss": quality + config.lam * capacity, "kl": kl, "capacity": capacity}


def _resume(
    out: Path, config: TrainConfig, gates: RetentionGates, optimizer: torch.optim.Optimizer
) -> tuple[int, float]:
    """Load a saved state written with the same config: `(steps done, seconds spent)`; `(0, 0.0)` if none."""
    path = out / STATE_FILE
    if not path.is_file():
        return 0, 0.0
    state = torch.load(path, weights_only=True)
    if state["config"] != dataclasses.asdict(config):
        raise ValueError(f"{path} was saved by a run with other settings; remove it or choose another --out")
    gates.load_state_dict(state["gates"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"]), float(state["seconds"])


def train_gates(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    config: TrainConfig,
    out: str | Path,
    model_name: str,
    data: TrainingData | None = None,
    show_progress: bool = True,
) -> tuple[RetentionGates, TrainRecord]:
    """Train gates for `model` and write the checkpoint to `out` (resuming a run saved there)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = data or training_data(tokenizer, config.seq_len, config.per_task, config.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        gates = RetentionGates(gate_shape(model, config.width), config.bias_init).to(model.device)
    optimizer = torch.optim.Adam(gates.parameters(), lr=config.lr)
    step, seconds = _resume(out, config, gates, optimizer)
    cos, sin = find_rotary(model)(torch.arange(config.seq_len, device=model.device))
    tape = RetentionTape(gates, cos, sin)
    model.eval()
    draws = torch.Generator().manual_seed(config.seed)
    for _ in range(step):  # a resumed run draws the positions the uninterrupted one would
        loss_positions(config.seq_len, config.kl_tokens, draws)
    with progress_bar(
        "train-gates", fields="loss {task.fields[loss]:.4f}", visible=show_progress, loss=0.0
    ) as progress:
        progress(step, config.steps)
        while step < config.steps:
            start = time.perf_counter()
            ids = data.sequences[step % len(data.sequences)].to(model.device)
            if config.target == "kvzip":
                terms = kvzip_step(model, tokenizer, gates, ids, config.capacity)
            else:
                positions = loss_positions(ids.shape[1], config.kl_tokens, draws)
                terms = train_step(model, gates, tape, ids, config, positions)
            optimizer.zero_grad()
            torch.autograd.backward(terms["loss"], inputs=list(gates.parameters()))
            optimizer.step()
            step, seconds = step + 1, seconds + time.perf_counter() - start
            progress(step, config.steps, loss=terms["loss"].item())
            if step % config.save_every == 0 or step == config.steps:
                state = {"gates": gates.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
                torch.save(state | {"seconds": seconds, "config": dataclasses.asdict(config)}, out / STATE_FILE)
    record = TrainRecord(
        model_name=model_name,
        model_hash=model_fingerprint(model),
        architecture=type(model).__name__,
        capacity=config.capacity,
        scope=config.scope,
        lam=config.lam,
        steps=config.steps,
        seq_len=config.seq_len,
        seed=config.seed,
        data=data.split | {"config": dataclasses.asdict(config)},
        seconds=round(seconds, 1),
    )
    save_gates(gates, record, out)
    return gates.eval().requires_grad_(False), record
