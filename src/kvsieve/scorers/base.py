"""The scorer contract: one number per stored entry, higher = keep."""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from ..observe import Observation


class Scorer(Protocol):
    """A rule giving every entry of one layer a score; a pure function of the `Observation`.

    `needs_accumulated` says whether the scorer reads `Observation.received` (the attention
    summed over all prefill queries), which makes the observed prefill slower.
    """

    name: ClassVar[str]
    needs_accumulated: ClassVar[bool]

    def score(self, obs: Observation) -> torch.Tensor:
        """Scores `[kv_heads, n]`; higher means keep."""
        ...
