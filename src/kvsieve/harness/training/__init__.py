"""Learned retention gates (TrimKV / DBTrimKV): the module, soft-retention training, checkpoints."""

from ...selection.checkpoint import GateCheckpointError, TrainRecord, load_gates, read_gates, save_gates
from ...selection.gates import GateShape, RetentionGates, gate_shape
from .train import TrainConfig, train_gates

__all__ = [
    "GateCheckpointError",
    "GateShape",
    "RetentionGates",
    "TrainConfig",
    "TrainRecord",
    "gate_shape",
    "load_gates",
    "read_gates",
    "save_gates",
    "train_gates",
]
