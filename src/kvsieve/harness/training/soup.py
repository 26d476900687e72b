"""A gate soup: the weighted average of the parameters of gates trained from the same start (model soups, arXiv
2203.05482).

Gates trained from one seed on different objectives (the full cache's output; KVzip's keep decision mixed in) average
into one checkpoint, scored in one pass like any other; what a soup keeps is measured in benchmarks/gate_ablation.py.
Gates trained from different seeds combine as an ensemble instead (`ensemble.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ...selection.checkpoint import GateCheckpointError, save_gates
from .combine import combined_record, read_members


def average_gates(sources: Sequence[str | Path], weights: Sequence[float] | None, out: str | Path) -> Path:
    """Write to `out` the gates whose every parameter is the `weights`-weighted mean (None: equal weights) of the
    checkpoints in `sources` (same model, same shape, same seed)."""
    sources = [Path(source) for source in sources]
    members, weights = read_members(sources, weights, same_width=True)
    first = members[0][1]
    for source, (_, record) in zip(sources[1:], members[1:], strict=True):
        if record.seed != first.seed:
            raise GateCheckpointError(
                f"{source} was trained from seed {record.seed}, {sources[0]} from seed {first.seed}: only gates "
                "trained from the same start average (train every ingredient with the same --seed, or combine them "
                "with `kvsieve ensemble-gates`)"
            )
    gates = members[0][0]
    states = [g.state_dict() for g, _ in members]
    gates.load_state_dict({k: sum(w * state[k] for w, state in zip(weights, states, strict=True)) for k in states[0]})
    return save_gates(gates, combined_record(members, sources, weights, "soup"), out)
