"""KeyDiff: keep the keys least similar to the average key (arXiv 2504.15364)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..observe import Observation


@dataclass(frozen=True)
class KeyDiffScorer:
    """Minus the cosine similarity of each key to the mean of the head's normalised keys (the anchor).

    Distinctive keys are kept; needs no attention at all.
    """

    name: ClassVar[str] = "keydiff"
    needs_accumulated: ClassVar[bool] = False

    def score(self, obs: Observation) -> torch.Tensor:
        keys = F.normalize(obs.keys.float(), dim=-1)
        anchor = keys.mean(dim=1, keepdim=True)
        return -F.cosine_similarity(keys, anchor, dim=-1)
