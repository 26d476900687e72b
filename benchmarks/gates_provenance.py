"""Which shipped default gates a benchmark's `trimkv` rows read, so a result says which checkpoint made it."""

from __future__ import annotations

import hashlib

import torch

from kvsieve.selection.checkpoint import WEIGHTS_FILE, read_gates, shipped_gates_for
from kvsieve.selection.policy import projection_parameters


def default_gates(model: torch.nn.Module) -> dict[str, str] | None:
    """The shipped checkpoint `trimkv` reads for `model` by default: its name, the SHA-256 of its weights (first
    12 hex digits) and, where it records one, the projection a policy naming none picks with; None where the
    model has none."""
    folder = shipped_gates_for(model)
    if folder is None:
        return None
    digest = hashlib.sha256((folder / WEIGHTS_FILE).read_bytes()).hexdigest()
    projection = read_gates(folder)[0].projection
    recorded = {} if projection is None else {"projection": ",".join(projection_parameters(projection))}
    return {"name": folder.name, "sha256": digest[:12]} | recorded


def gates_note(gates: dict[str, str] | None) -> str:
    """A caption's sentence naming the default gates a report recorded ("" for a report without them)."""
    if not gates:
        return ""
    projection = f", `{gates['projection']}` where a policy names none" if "projection" in gates else ""
    return f" `trimkv` read the shipped gates `{gates['name']}` (weights {gates['sha256']}{projection})."
