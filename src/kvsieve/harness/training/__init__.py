"""Training retention gates (TrimKV / DBTrimKV) for a frozen model: data, soft retention, losses, the loop.

The gates and their checkpoints are `kvsieve.modeling.gates` and `kvsieve.selection.checkpoint`.
"""

from .train import TrainConfig, train_gates

__all__ = ["TrainConfig", "train_gates"]
