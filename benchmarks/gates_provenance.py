"""Which shipped default gates a benchmark's `trimkv` rows read, so a result says which checkpoint made it."""

from __future__ import annotations

import hashlib

import torch

from kvsieve.selection.checkpoint import WEIGHTS_FILE, shipped_gates_for


def default_gates(model: torch.nn.Module) -> dict[str, str] | None:
    """The shipped checkpoint `trimkv` reads for `model` by default: its name and the SHA-256 of its weights
    (first 12 hex digits); None where the model has none."""
    folder = shipped_gates_for(model)
    if folder is None:
        return None
    digest = hashlib.sha256((folder / WEIGHTS_FILE).read_bytes()).hexdigest()
    return {"name": folder.name, "sha256": digest[:12]}


def gates_note(gates: dict[str, str] | None) -> str:
    """A caption's sentence naming the default gates a report recorded ("" for a report without them)."""
    return f" `trimkv` read the shipped gates `{gates['name']}` (weights {gates['sha256']})." if gates else ""
