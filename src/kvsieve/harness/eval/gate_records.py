"""Which retention gates a results row's policy read, so that a resumed run never mixes rows of other gates.

A policy's name stays the same when the checkpoint behind it changes (``trimkv`` reads the shipped
default of the model at hand, which a release may replace; a checkpoint folder may be trained again
in place). So each row of a policy that reads gates records them, `gates`: each source it reads with
the fingerprint of what loaded (`gates_fingerprint`: weights, horizons, recorded projection). A
results log read back refuses rows whose record differs from this run's (`ResultsLog`'s `made_by`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ...runtime.observing.facts import needed_gates
from ...selection.checkpoint import gates_fingerprint
from ...selection.observation import Needs
from ..runners import Runner, run_once
from .methods import CacheMethod
from .results_log import Row

#: The row field that records the gates a policy read, e.g. ``"default=3f2a9c0d41be"``.
GATES_FIELD = "gates"


@dataclass(frozen=True)
class GateFingerprints:
    """The fingerprint of each gate source, loaded for the model where it lives (a `Work` on no cell)."""

    sources: tuple[str, ...]

    def __call__(self, model: torch.nn.Module, tokenizer: Any, cell: None) -> dict[str, str]:
        gates = needed_gates(model, Needs(gates=self.sources))
        return {source: gates_fingerprint(loaded) for source, loaded in gates.items()}


def gates_made_by(runner: Runner, methods: Mapping[str, CacheMethod]) -> Callable[[Row], Row]:
    """A results log's `made_by` for rows of `methods` (by the name rows give them in ``policy``): a row of a
    policy that reads gates records them as ``source=fingerprint`` (sources joined by ``;``)."""
    reads = {name: method.needs.gates for name, method in methods.items() if method.needs.gates}
    sources = tuple(sorted({source for read in reads.values() for source in read}))
    fingerprints = run_once(runner, GateFingerprints(sources), None) if sources else {}
    records = {name: ";".join(f"{source}={fingerprints[source]}" for source in read) for name, read in reads.items()}
    return functools.partial(_made_by, records)


def _made_by(records: dict[str, str], row: Row) -> Row:
    record = records.get(row.get("policy"))
    return {} if record is None else {GATES_FIELD: record}
