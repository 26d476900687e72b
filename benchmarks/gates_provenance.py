"""Which shipped default gates a benchmark's `trimkv` rows read, so a result says which checkpoint made it."""

from __future__ import annotations

import hashlib

import torch

from kvsieve.selection.checkpoint import WEIGHTS_FILE, read_gates, shipped_gates_for
from kvsieve.selection.policy import merge_parameters, projection_parameters


def default_gates(model: torch.nn.Module) -> dict[str, str] | None:
    """The shipped checkpoint `trimkv` reads for `model` by default: its name, the SHA-256 of its weights (first
    12 hex digits) and, where it records them, the projection a policy naming none picks with and the merge one
    naming none folds with; None where the model has none."""
    folder = shipped_gates_for(model)
    if folder is None:
        return None
    digest = hashlib.sha256((folder / WEIGHTS_FILE).read_bytes()).hexdigest()
    gates = read_gates(folder)[0]
    recorded = {} if gates.projection is None else {"projection": ",".join(projection_parameters(gates.projection))}
    recorded |= {} if gates.merge is None else {"merge": ",".join(merge_parameters(gates.merge))}
    return {"name": folder.name, "sha256": digest[:12]} | recorded


def gates_note(gates: dict[str, str] | None) -> str:
    """A caption's sentence naming the default gates a report recorded ("" for a report without them)."""
    if not gates:
        return ""
    recorded = " and ".join(f"`{gates[key]}`" for key in ("projection", "merge") if key in gates)
    recorded = f", {recorded} where a policy names none" if recorded else ""
    return f" `trimkv` read the shipped gates `{gates['name']}` (weights {gates['sha256']}{recorded})."
