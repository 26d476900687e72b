"""KVzip: the attention an entry receives while the model repeats its own context (arXiv 2505.23416)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..observation import Needs, Observation, Reconstruction

#: The instruction fed after the context before the model repeats it.
REPEAT_PROMPT = "\n\nRepeat the previous context exactly."


@dataclass(frozen=True)
class KVzipScorer:
    """Most attention from any query of the reconstruction pass, the max over a kv-head's query heads.

    Question-agnostic: an entry the model needs to reproduce its context is one any later question
    may need. The reconstruction is a second pass over the context (`chunk` tokens a forward, each
    on a copy of the cache), several prefills' worth on a small model (`benchmarks/prefill_overhead.py`).
    A chunked prefill repeats everything fed so far at each eviction; re-scoring during generation is
    not defined (`kvsieve.runtime.api.compress`).
    Scores are attention probabilities, comparable across layers and heads, which is why the paper
    ranks them under one global budget (``kvzip+global``).
    """

    name: ClassVar[str] = "kvzip"
    calibrated: ClassVar[bool] = True
    chunk: int = 2048
    prompt: str = REPEAT_PROMPT

    def __post_init__(self) -> None:
        if not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"chunk must be an integer >= 1, got {self.chunk!r}")

    @property
    def needs(self) -> Needs:
        return Needs(reconstruction=Reconstruction(self.prompt, self.chunk))

    def score(self, obs: Observation) -> torch.Tensor:
        return obs.reconstructed(self.name).unflatten(0, (obs.num_kv_heads, -1)).amax(dim=1)
