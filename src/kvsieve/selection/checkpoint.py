"""Retention-gate checkpoints: `gates.safetensors` plus `config.json`, tied to one model by a hash of its weights.

`config.json` records the gates' shape, the horizons a scorer reads them at by default, the
projection a policy reading them picks with and the merge it folds what a head evicts with when it names
none (if any; `Policy.select`, `Policy.merged`), the model
(name and weights hash) and how they were trained (`TrainRecord`). Loading checks the shape and the
model: gates for another model, or for other dimensions, are a clear error. Checkpoints shipped with
kvsieve live in `kvsieve/selection/checkpoints/<name>/` and load by that name; ``"default"`` picks the
one trained for the model at hand that is named after the model (a checkpoint it replaced keeps
shipping under another name, for comparison).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..modeling.fingerprint import model_fingerprint
from ..modeling.gates import GateShape, Horizons, RetentionGates, gate_shape
from .allocators import ALLOCATORS
from .merge import make_merge, merge_record
from .projection import from_record, projection_record

WEIGHTS_FILE = "gates.safetensors"
CONFIG_FILE = "config.json"
SHIPPED = Path(__file__).parent / "checkpoints"
DEFAULT_GATES = "default"
#: Gates as initialised (seed 0), for any model: the ablation that shows what training bought.
UNTRAINED_GATES = "untrained"


class GateCheckpointError(ValueError):
    """A retention-gate checkpoint is missing, malformed, or made for another model."""


@dataclass(frozen=True)
class TrainRecord:
    """How a set of gates was made (stored in `config.json`)."""

    model_name: str
    model_hash: str
    capacity: int
    scope: str
    lam: float
    steps: int
    seq_len: int
    seed: int
    data: dict = field(default_factory=dict)
    seconds: float = 0.0
    architecture: str = ""  # the model class, e.g. "LlamaForCausalLM" (empty in checkpoints before kvsieve 0.2)

    @classmethod
    def from_dict(cls, train: dict) -> TrainRecord:
        """The record of a `config.json` (before kvsieve 0.2, `capacity` was called `budget` and `scope` `capacity`)."""
        if "budget" in train:
            renamed = {"capacity": train["budget"], "scope": train["capacity"]}
            train = {k: v for k, v in train.items() if k not in ("budget", "capacity")} | renamed
        return cls(**train)


def save_gates(gates: RetentionGates, record: TrainRecord, out: str | Path) -> Path:
    """Write `gates.safetensors` and `config.json` into `out` (created if needed)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in gates.state_dict().items()}, str(out / WEIGHTS_FILE))
    config = {"shape": gates.shape.to_dict(), **_horizons_record(gates), **_recorded(gates), "train": asdict(record)}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def _as_json(horizon: float) -> float | str:
    return horizon if math.isfinite(horizon) else "inf"  # JSON has no infinity


def _horizons_record(gates: RetentionGates) -> dict[str, float | str]:
    """The horizons as `config.json` records them."""
    return {"horizon": _as_json(gates.horizons.once), "bounded_horizon": _as_json(gates.horizons.bounded)}


def _recorded(gates: RetentionGates) -> dict[str, object]:
    """The projection and the merge as `config.json` records them (each only if the gates have one)."""
    projection = {} if gates.projection is None else {"projection": projection_record(gates.projection)}
    return projection | ({} if gates.merge is None else {"merge": merge_record(gates.merge)})


def read_gates(folder: str | Path) -> tuple[RetentionGates, TrainRecord]:
    """Load a checkpoint folder without checking it against a model."""
    folder = Path(folder)
    if not (folder / WEIGHTS_FILE).is_file() or not (folder / CONFIG_FILE).is_file():
        stem, _, allocator = str(folder).rpartition("+")
        if allocator in ALLOCATORS:
            hint = f"; the allocator goes before the parameters: 'trimkv+{allocator}:gates={stem}'"
        else:
            hint = f"; the shipped checkpoints, by name: {', '.join(p.name for p in shipped_checkpoints())}"
        raise GateCheckpointError(
            f"{folder} is not a retention-gate checkpoint (needs {WEIGHTS_FILE} and {CONFIG_FILE}){hint}"
        )
    config = json.loads((folder / CONFIG_FILE).read_text())
    try:
        horizons = Horizons(config.get("horizon", 0.0), config.get("bounded_horizon"))
        projection = None if "projection" not in config else from_record(config["projection"])
        merge = make_merge(config.get("merge"))
        shape = GateShape.from_dict(config["shape"])
        gates = RetentionGates(shape, horizons=horizons, projection=projection, merge=merge)
    except ValueError as err:
        raise GateCheckpointError(f"{folder / CONFIG_FILE}: {err}") from None
    try:
        gates.load_state_dict(load_file(str(folder / WEIGHTS_FILE)))
    except RuntimeError as err:
        raise GateCheckpointError(f"{folder}: the weights do not match config.json: {err}") from None
    return gates.eval().requires_grad_(False), TrainRecord.from_dict(config["train"])


def gates_fingerprint(gates: RetentionGates) -> str:
    """12 hex digits of a SHA-256 over all that decides what a policy reading `gates` keeps: the weights, the
    horizons, the recorded projection and merge (not the training record: gates trained again bit for bit match)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(gates.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    recorded = {"projection": None} | _recorded(gates)  # gates that record no merge hash as before merges existed
    digest.update(json.dumps(_horizons_record(gates) | recorded, sort_keys=True).encode())
    return digest.hexdigest()[:12]


def shipped_checkpoints() -> list[Path]:
    """The checkpoint folders shipped inside the package."""
    return sorted(p for p in SHIPPED.glob("*") if (p / CONFIG_FILE).is_file()) if SHIPPED.is_dir() else []


def shipped_gates_for(model: torch.nn.Module) -> Path | None:
    """The default shipped checkpoint for `model`: trained for its weights hash and named after it; or None."""
    fingerprint = model_fingerprint(model)
    for folder in shipped_checkpoints():
        train = json.loads((folder / CONFIG_FILE).read_text())["train"]
        if train["model_hash"] == fingerprint and folder.name == train["model_name"]:
            return folder
    return None


def resolve_gates(source: str | Path) -> Path:
    """`source` as a folder: itself if it exists, else the shipped checkpoint of that name."""
    shipped = SHIPPED / str(source)
    if Path(source).exists() or Path(source).name != str(source) or not (shipped / CONFIG_FILE).is_file():
        return Path(source)
    return shipped


def check_shape(gates: RetentionGates, model: torch.nn.Module) -> None:
    """A clear error unless the gates cover `model`'s full-attention layers, kv-heads and head dimension."""
    have, want = gates.shape, gate_shape(model, gates.shape.width)
    if have != want:
        raise GateCheckpointError(
            f"these retention gates were made for layers {list(have.layers)}, {have.kv_heads} kv-heads of "
            f"dimension {have.head_dim}; {type(model).__name__} has full-attention layers {list(want.layers)}, "
            f"{want.kv_heads} kv-heads of dimension {want.head_dim}"
        )


def load_gates(source: str | Path, model: torch.nn.Module) -> RetentionGates:
    """The gates in `source`, checked against `model`.

    `source` is a checkpoint folder, the name of a shipped checkpoint, ``"default"`` (the shipped gates
    trained for `model`) or ``"untrained"`` (freshly initialised gates, seed 0).
    """
    device = next(model.parameters()).device
    if str(source) == UNTRAINED_GATES:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return RetentionGates(gate_shape(model)).to(device).eval().requires_grad_(False)
    fingerprint = model_fingerprint(model)
    if str(source) == DEFAULT_GATES:
        source = shipped_gates_for(model)
        if source is None:
            raise GateCheckpointError(
                f"kvsieve ships no retention gates for this {type(model).__name__} (weights hash {fingerprint}); "
                "train them with `kvsieve train-gates --model ... --out DIR` and use the policy 'trimkv:gates=DIR'"
            )
    source = resolve_gates(source)
    gates, record = read_gates(source)
    if record.architecture and record.architecture != type(model).__name__:
        raise GateCheckpointError(
            f"the retention gates in {source} were trained for a {record.architecture} ({record.model_name}); "
            f"this model is a {type(model).__name__}: train gates for it with `kvsieve train-gates`"
        )
    check_shape(gates, model)
    if record.model_hash != fingerprint:
        raise GateCheckpointError(
            f"the retention gates in {source} were trained for {record.model_name} (weights hash {record.model_hash}), "
            f"not for this model (weights hash {fingerprint})"
        )
    return gates.to(device)
