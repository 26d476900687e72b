"""What gate soups and gate ensembles share: their weights, their members' checks and the record they write."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from ...modeling.gates import GateShape, RetentionGates
from ...selection.checkpoint import GateCheckpointError, TrainRecord, read_gates

Member = tuple[RetentionGates, TrainRecord]


def check_weights(weights: Sequence[float], count: int) -> None:
    """One non-negative weight per checkpoint, summing to 1."""
    if len(weights) != count:
        raise ValueError(f"{count} gate checkpoints need {count} weights, got {len(weights)}")
    if any(w < 0 for w in weights) or abs(sum(weights) - 1) > 1e-6:
        raise ValueError(f"the weights of gate checkpoints combined are non-negative and sum to 1, got {list(weights)}")


def read_members(
    sources: Sequence[Path], weights: Sequence[float] | None, *, same_width: bool
) -> tuple[list[Member], list[float]]:
    """The checkpoints in `sources` and their weights (None: equal), refused unless they are gates of one model with
    the same layers and heads (and, where `same_width`, the same hidden width)."""
    weights = [1 / len(sources)] * len(sources) if weights is None else list(weights)
    check_weights(weights, len(sources))
    members = [read_gates(source) for source in sources]
    (gates, first), rest = members[0], members[1:]

    def geometry(shape: GateShape) -> GateShape:
        return shape if same_width else dataclasses.replace(shape, width=0)

    for source, (other, record) in zip(sources[1:], rest, strict=True):
        if geometry(other.shape) != geometry(gates.shape) or record.model_hash != first.model_hash:
            raise GateCheckpointError(
                f"{source} holds gates for {record.model_name} (weights hash {record.model_hash}, shape "
                f"{other.shape}); {sources[0]} for {first.model_name} ({first.model_hash}, {gates.shape}): "
                "only gates of one model and one shape combine"
            )
    return members, weights


def combined_record(
    members: Sequence[Member], sources: Sequence[Path], weights: Sequence[float], kind: str
) -> TrainRecord:
    """The record of checkpoints combined: the first one's settings; steps and seconds summed; every member's record
    with its weight under `data[kind]` ("soup", "ensemble")."""
    records = [record for _, record in members]
    parts = [
        {"source": str(source), "weight": weight, "train": dataclasses.asdict(record)}
        for source, weight, record in zip(sources, weights, records, strict=True)
    ]
    return dataclasses.replace(
        records[0],
        steps=sum(r.steps for r in records),
        seq_len=max(r.seq_len for r in records),
        seconds=sum(r.seconds for r in records),
        data={kind: parts},
    )
