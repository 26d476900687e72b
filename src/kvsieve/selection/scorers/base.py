"""The scorer contract: one number per stored entry, higher = keep."""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from ..observation import Needs, Observation


class Scorer(Protocol):
    """A rule giving every entry of one layer a score, from an `Observation`.

    `needs` declares what the scorer reads besides the entries (recent queries, accumulated
    attention, ...); the observed prefill records exactly that. A scorer may be a frozen
    dataclass (a formula) or an `nn.Module` with learned parameters.
    """

    name: ClassVar[str]
    #: whether scores of all layers and heads already share one scale (the `global` allocator then pools them raw)
    calibrated: ClassVar[bool]

    @property
    def needs(self) -> Needs: ...

    def score(self, obs: Observation) -> torch.Tensor:
        """Scores `[kv_heads, n]`; higher means keep. Entries that do not exist (`obs.valid`) are ignored."""
        ...


def check_window(window: int) -> None:
    """A query window holds at least one query."""
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1, got {window!r}")
