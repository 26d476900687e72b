"""kvsieve inside lm-evaluation-harness (`pip install "kvsieve[lm-eval]"`): importing this package registers
the lm-eval model type ``kvsieve`` (`kvsieve.harness.lmeval.model.KVSieveLM`)."""

from .model import MODEL_TYPE, KVSieveLM

__all__ = ["MODEL_TYPE", "KVSieveLM"]
