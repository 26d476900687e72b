"""KeyDiff: keep the keys least similar to the average key (arXiv 2504.15364)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..observation import Needs, Observation


@dataclass(frozen=True)
class KeyDiffScorer:
    """Minus the cosine similarity of each key to the mean of the head's normalised keys (the anchor).

    Distinctive keys are kept; needs no attention at all.
    """

    name: ClassVar[str] = "keydiff"
    calibrated: ClassVar[bool] = False
    needs: ClassVar[Needs] = Needs()

    def score(self, obs: Observation) -> torch.Tensor:
        keys = F.normalize(obs.keys.float(), dim=-1)
        valid = obs.valid_mask[..., None].float()
        anchor = (keys * valid).sum(dim=1, keepdim=True) / valid.sum(dim=1, keepdim=True).clamp(min=1)
        return -F.cosine_similarity(keys, anchor, dim=-1)
