"""A gate soup: the weighted average of the parameters of gates trained from the same start (model soups, arXiv
2203.05482).

Gates trained from one seed on different objectives (the full cache's output; KVzip's keep decision mixed in) average
into one checkpoint, scored in one pass like any other; what a soup keeps is measured in benchmarks/gate_ablation.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from ...selection.checkpoint import GateCheckpointError, TrainRecord, read_gates, save_gates


def check_weights(weights: Sequence[float], count: int) -> None:
    """One non-negative weight per ingredient, summing to 1."""
    if len(weights) != count:
        raise ValueError(f"{count} gate checkpoints need {count} weights, got {len(weights)}")
    if any(w < 0 for w in weights) or abs(sum(weights) - 1) > 1e-6:
        raise ValueError(f"the weights of a gate soup are non-negative and sum to 1, got {list(weights)}")


def soup_record(records: Sequence[TrainRecord], sources: Sequence[Path], weights: Sequence[float]) -> TrainRecord:
    """The record of a soup: its first ingredient's settings; steps and seconds summed; every ingredient's record
    with its weight under `data["soup"]`."""
    first = records[0]
    ingredients = [
        {"source": str(source), "weight": weight, "train": dataclasses.asdict(record)}
        for source, weight, record in zip(sources, weights, records, strict=True)
    ]
    return dataclasses.replace(
        first,
        steps=sum(r.steps for r in records),
        seq_len=max(r.seq_len for r in records),
        seconds=sum(r.seconds for r in records),
        data={"soup": ingredients},
    )


def average_gates(sources: Sequence[str | Path], weights: Sequence[float] | None, out: str | Path) -> Path:
    """Write to `out` the gates whose every parameter is the `weights`-weighted mean (None: equal weights) of the
    checkpoints in `sources` (same model, same shape)."""
    sources = [Path(source) for source in sources]
    weights = [1 / len(sources)] * len(sources) if weights is None else weights
    check_weights(weights, len(sources))
    loaded = [read_gates(source) for source in sources]
    (gates, first), rest = loaded[0], loaded[1:]
    for source, (other, record) in zip(sources[1:], rest, strict=True):
        if other.shape != gates.shape or record.model_hash != first.model_hash:
            raise GateCheckpointError(
                f"{source} holds gates for {record.model_name} (weights hash {record.model_hash}, shape "
                f"{other.shape}); {sources[0]} for {first.model_name} ({first.model_hash}, {gates.shape}): "
                "only gates of one model and one shape average"
            )
        if record.seed != first.seed:
            raise GateCheckpointError(
                f"{source} was trained from seed {record.seed}, {sources[0]} from seed {first.seed}: only gates "
                "trained from the same start average (train every ingredient with the same --seed)"
            )
    states = [g.state_dict() for g, _ in loaded]
    gates.load_state_dict({k: sum(w * state[k] for w, state in zip(weights, states, strict=True)) for k in states[0]})
    return save_gates(gates, soup_record([r for _, r in loaded], sources, weights), out)
