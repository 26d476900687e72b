"""Train retention gates on a frozen model: soft retention, distillation from the full cache, the capacity hinge.

Each step feeds one sequence twice: once with the model's own attention (the teacher: the full
cache), once under soft retention (the student). Loss = quality (forward KL to the teacher, averaged
with the next-token loss if asked) + `lam` x capacity hinge (`kvsieve.harness.training.losses`). With
``target="kvzip"`` the teacher is KVzip's keep decision instead (`kvsieve.harness.training.kvzip_target`:
the model runs forward only); with `kvzip_weight` in (0, 1) the two are mixed: KVzip's keep decision takes that
share of the quality term. With `answer_weight`, the KL at the positions that predict a training sample's gold
answer is added again with that weight (a few tokens in a thousand, but those where a question reads its evidence).
A curriculum trains on sequences of growing length, in equal shares of the steps.
Only the gates receive gradients; the model is not modified. Progress is saved every `save_every` steps, and a
rerun with the same arguments resumes from there; with the same seed, a run is repeatable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ...modeling.fingerprint import model_fingerprint
from ...modeling.gates import DEFAULT_BIAS_INIT, DEFAULT_WIDTH, NEXT_STEP, Horizons, RetentionGates, gate_shape
from ...modeling.rotary import find_rotary
from ...selection.checkpoint import TrainRecord, save_gates
from ...selection.projection import Projection
from ..progress import progress_bar
from .data import TRAINING_TASKS, TrainingData, training_data, training_tasks
from .kvzip_target import KEEP_ENTRIES, check_capacity, kvzip_step
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
        tasks: the tasks or suites (`kvsieve.harness.data.SUITES`) those samples come from; never ``unseen``.
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
        kvzip_weight: with target ``"kl"``, the share of the quality term given to KVzip's keep decision (in
            `[0, 1]`; 0: the full cache's output alone): `(1 - w) * KL + w * keep loss`, then the capacity hinge.
        kvzip_entries: with `kvzip_weight`, the entries the keep loss reads (`KEEP_ENTRIES`): ``"all"`` evictable
            ones; ``"kept"``: KVzip's kept ones alone (raised, none pushed down); ``"indifferent"``: the half whose
            `log beta` moves the output term least (its gradient's size, at most the median), so KVzip decides
            only where the full cache's output does not.
        curriculum: sequence lengths the steps go through in equal shares (e.g. `(1024, 4096)`); empty: `seq_len`.
        answer_weight: with target ``"kl"``, the weight of the mean KL at the positions that predict a training
            sample's gold answer, added to the quality term (0: they count as any drawn position).
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
    tasks: str = TRAINING_TASKS
    kl_tokens: int = 256
    teacher_dtype: str | None = None
    seed: int = 0
    save_every: int = 25
    target: str = "kl"
    kvzip_weight: float = 0.0
    kvzip_entries: str = "all"
    curriculum: tuple[int, ...] = ()
    answer_weight: float = 0.0

    def made(self, saved: dict) -> bool:
        """Whether settings a run saved (in a state file or a checkpoint's record) are these; a setting added since
        then had its default."""
        return json.loads(json.dumps(dataclasses.asdict(TrainConfig()) | saved)) == json.loads(
            json.dumps(dataclasses.asdict(self))
        )

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")
        if self.teacher_dtype not in TEACHER_DTYPES:
            raise ValueError(f"teacher_dtype must be one of {TEACHER_DTYPES}, got {self.teacher_dtype!r}")
        training_tasks(self.tasks)
        if self.kl_tokens < 0:
            raise ValueError(f"kl_tokens must be >= 0, got {self.kl_tokens}")
        for name in ("capacity", "steps", "seq_len", "width", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.kvzip_weight <= 1.0:
            raise ValueError(
                f"kvzip_weight must be in [0, 1] (the share of KVzip's keep decision), got {self.kvzip_weight}"
            )
        if self.kvzip_weight and self.target != "kl":
            raise ValueError("kvzip_weight mixes KVzip's keep decision into target 'kl'; target 'kvzip' uses it alone")
        if self.kvzip_entries not in KEEP_ENTRIES:
            raise ValueError(f"kvzip_entries must be one of {KEEP_ENTRIES}, got {self.kvzip_entries!r}")
        if self.kvzip_entries != "all" and not self.kvzip_weight:
            raise ValueError("kvzip_entries chooses what the keep loss reads: give a kvzip_weight > 0")
        if self.answer_weight < 0:
            raise ValueError(f"answer_weight must be >= 0, got {self.answer_weight}")
        if self.answer_weight and self.target != "kl":
            raise ValueError("answer_weight weighs the full cache's output at answers; target 'kvzip' has no output")
        if len(self.curriculum) > self.steps:
            raise ValueError(
                f"a curriculum of {len(self.curriculum)} lengths needs at least as many steps, got {self.steps}"
            )
        for length in self.lengths:
            if self.capacity >= length:
                raise ValueError(
                    f"capacity {self.capacity} must be below every sequence length, got {length}: "
                    "nothing would be evicted"
                )

    @property
    def lengths(self) -> tuple[int, ...]:
        """The sequence length of each phase: the curriculum, or `seq_len` alone."""
        return tuple(self.curriculum) or (self.seq_len,)

    @property
    def asks_kvzip(self) -> bool:
        """Whether KVzip's keep decision is (part of) the target (the model repeats its context: tokenizer needed)."""
        return self.target == "kvzip" or self.kvzip_weight > 0

    def phase_of(self, step: int) -> tuple[int, int]:
        """`(phase, steps into it)` of step `step` (from 0): equal shares of the steps, the remainder in the last."""
        share = self.steps // len(self.lengths)
        phase = min(step // share, len(self.lengths) - 1)
        return phase, step - phase * share


def loss_positions(length: int, count: int, generator: torch.Generator) -> torch.Tensor | None:
    """`count` distinct positions of a `length`-token sequence, sorted, drawn uniformly (None: all of them)."""
    if count == 0 or count >= length:
        return None
    return torch.randperm(length, generator=generator)[:count].sort().values


def answer_positions(length: int, answer: int) -> torch.Tensor:
    """The positions whose next token is one of the last `answer` tokens of a `length`-token sequence."""
    answer = min(answer, length - 1)
    return torch.arange(length - answer - 1, length - 1)


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
    answer: int = 0,
) -> dict[str, torch.Tensor]:
    """One sequence: the teacher's logits, the student's under soft retention, and the loss terms (graph kept).

    `positions`: the steps the loss terms read (None: every position). `answer`: how many of the last tokens are a
    gold answer, whose predicting positions `config.answer_weight` weighs again.
    """
    drawn = torch.arange(ids.shape[1]) if positions is None else positions
    asked = answer_positions(ids.shape[1], answer) if config.answer_weight and answer else drawn[:0]
    read = torch.cat([drawn, asked]).to(ids.device)  # transformers' logits_to_keep: the positions given
    with torch.no_grad(), teacher_precision(config.teacher_dtype, ids.device):
        teacher = model(input_ids=ids, use_cache=False, logits_to_keep=read).logits
    tape.log_beta.clear()
    with soft_retention(model, tape):
        student = model(input_ids=ids, use_cache=False, logits_to_keep=read).logits
    split = len(drawn)
    kl = forward_kl(student[:, :split], teacher[:, :split])
    quality = (kl + next_token_loss(student[:, :split], ids, positions)) / 2 if config.ntp else kl
    terms = {"kl": kl}
    if len(asked):
        terms["answer"] = forward_kl(student[:, split:], teacher[:, split:])
        quality = quality + config.answer_weight * terms["answer"]
    capacity = capacity_loss(tape.log_beta.values(), config.capacity, config.scope, positions)
    return terms | {"loss": quality + config.lam * capacity, "quality": quality, "capacity": capacity}


def output_sensitivity(quality: torch.Tensor, tape: RetentionTape) -> dict[int, torch.Tensor]:
    """Per gated layer, `[kv_heads, T]` how much the output term moves with each entry's `log beta`: the size of its
    gradient (the graph is kept for the step's own backward)."""
    layers = list(tape.log_beta)
    grads = torch.autograd.grad(quality, [tape.log_beta[layer] for layer in layers], retain_graph=True)
    return {layer: grad[0].abs().detach() for layer, grad in zip(layers, grads, strict=True)}


def objective_step(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    tape: RetentionTape,
    ids: torch.Tensor,
    config: TrainConfig,
    draws: torch.Generator,
    answer: int = 0,
) -> dict[str, torch.Tensor]:
    """One sequence under `config`'s objective: KVzip's keep decision, the full cache's output, or their mix.

    `answer`: how many of the sequence's last tokens are a gold answer.
    """
    if config.target == "kvzip":
        return kvzip_step(model, tokenizer, tape.gates, ids, config.capacity)
    positions = loss_positions(ids.shape[1], config.kl_tokens, draws)
    terms = train_step(model, tape.gates, tape, ids, config, positions, answer)
    if not config.kvzip_weight:
        return terms
    sensitivity = output_sensitivity(terms["quality"], tape) if config.kvzip_entries == "indifferent" else None
    keep = kvzip_step(model, tokenizer, tape.gates, ids, config.capacity, config.kvzip_entries, sensitivity)
    mixed = config.kvzip_weight * (keep["loss"] - terms["quality"])  # (1 - w) quality + w keep, with the hinge
    return terms | {"loss": terms["loss"] + mixed, "keep": keep["loss"], "recall": keep["recall"]}


def check_training(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, config: TrainConfig) -> None:
    """What `config` asks of `model` and its tokenizer, checked before any data is built or step taken."""
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None and max(config.lengths) > context:
        asked = "the curriculum's longest sequence" if config.curriculum else "seq_len"
        raise ValueError(f"{asked} ({max(config.lengths)} tokens) is longer than the model's context ({context})")
    if config.asks_kvzip and tokenizer is None:
        raise ValueError(
            "the kvzip target needs the model's tokenizer (KVzip makes the model repeat its context, as text); "
            "give train_gates the tokenizer, or train with target 'kl' and kvzip_weight 0"
        )
    if config.asks_kvzip:
        check_capacity(config.capacity)


def phase_data(
    tokenizer: PreTrainedTokenizerBase, config: TrainConfig, data: TrainingData | list[TrainingData] | None
) -> list[TrainingData]:
    """The training sequences of each curriculum phase: `data` as given, or the bundled data at each length."""
    if data is None:
        return [
            training_data(tokenizer, length, config.per_task, config.seed, config.tasks) for length in config.lengths
        ]
    phases = [data] if isinstance(data, TrainingData) else list(data)
    if len(phases) != len(config.lengths):
        raise ValueError(
            f"the curriculum has {len(config.lengths)} phases, the data {len(phases)}: give one per length"
        )
    return phases


def _resume(
    out: Path, config: TrainConfig, gates: RetentionGates, optimizer: torch.optim.Optimizer
) -> tuple[int, float]:
    """Load a saved state written with the same config: `(steps done, seconds spent)`; `(0, 0.0)` if none."""
    path = out / STATE_FILE
    if not path.is_file():
        return 0, 0.0
    state = torch.load(path, weights_only=True)
    if not config.made(state["config"]):
        raise ValueError(f"{path} was saved by a run with other settings; remove it or choose another --out")
    gates.load_state_dict(state["gates"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"]), float(state["seconds"])


def _sequence(phases: list[TrainingData], config: TrainConfig, step: int) -> tuple[torch.Tensor, int]:
    """The sequence step `step` trains on (its phase's sequences in turn, from the phase's first step), and how
    many of its last tokens are a gold answer."""
    phase, into = config.phase_of(step)
    index = into % len(phases[phase].sequences)
    return phases[phase].sequences[index], phases[phase].answer(index)


def _phase_record(phases: list[TrainingData]) -> dict:
    """What a checkpoint records of a curriculum's phases (nothing more for a single phase)."""
    return {"phase_sequences": [len(phase.sequences) for phase in phases]} if len(phases) > 1 else {}


def train_gates(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    config: TrainConfig,
    out: str | Path,
    model_name: str,
    data: TrainingData | list[TrainingData] | None = None,
    show_progress: bool = True,
    horizons: Horizons = NEXT_STEP,
    projection: Projection | None = None,
) -> tuple[RetentionGates, TrainRecord]:
    """Train gates for `model` and write the checkpoint to `out` (resuming a run saved there).

    `data`: the sequences, or one `TrainingData` per curriculum phase (default: the bundled data at each length).
    `horizons` and `projection`: what the checkpoint records for scorers to read the gates at and for policies that
    name no projection to pick with (`RetentionGates`; training uses neither).
    """
    check_training(model, tokenizer, config)
    phases = phase_data(tokenizer, config, data)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        shape = gate_shape(model, config.width)
        gates = RetentionGates(shape, config.bias_init, horizons, projection).to(model.device)
    optimizer = torch.optim.Adam(gates.parameters(), lr=config.lr)
    step, seconds = _resume(out, config, gates, optimizer)
    cos, sin = find_rotary(model)(torch.arange(max(config.lengths), device=model.device))
    tape = RetentionTape(gates, cos, sin)
    model.eval()
    draws = torch.Generator().manual_seed(config.seed)
    for done in range(step if config.target == "kl" else 0):  # a resumed run draws as the uninterrupted one would
        loss_positions(_sequence(phases, config, done)[0].shape[1], config.kl_tokens, draws)
    with progress_bar(
        "train-gates", fields="loss {task.fields[loss]:.4f}", visible=show_progress, loss=0.0
    ) as progress:
        progress(step, config.steps)
        while step < config.steps:
            start = time.perf_counter()
            ids, answer = _sequence(phases, config, step)
            terms = objective_step(model, tokenizer, tape, ids.to(model.device), config, draws, answer)
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
        data=phases[0].split | _phase_record(phases) | {"config": dataclasses.asdict(config)},
        seconds=round(seconds, 1),
    )
    save_gates(gates, record, out)
    return gates.eval().requires_grad_(False), record
