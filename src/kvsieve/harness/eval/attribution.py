"""Why a compressed cache fails a case: missed evidence, mis-scoring or broken coupling (arXiv 2605.08234).

A *failure* is a case the full cache gets right with margin > 0 and the compressed cache does not
(margin <= 0). Each failure gets the first cause that fits, in this order:

1. ``missed``: some evidence token is evicted by every kv-head of some layer that routes it in the
   full cache (`routed`: a query head of that layer pays the token at least the uniform share
   `1 / n_context` of its attention from the prefill's last query);
2. ``mis-scored``: not missed, and forcing in the evidence spans that heads evicted entirely, in
   place of the kept entries whose removal changes the attention output least (CAOTE's closed form),
   brings the margin back above 0 (`forced.ForcedSlots` with ``forcing="evicted"``);
3. ``broken``: not missed or mis-scored, and completing the evidence spans that heads kept only in
   part (the same swap, ``forcing="partial"``) brings the margin back above 0;
4. ``unexplained``: none of these.

Everything here is pure: survival masks, spans and margins in, labels out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...selection.observation import Observation
from .routing import head_attention

MODES_OF_FAILURE: tuple[str, ...] = ("missed", "mis-scored", "broken", "unexplained")

Spans = tuple[tuple[int, int], ...]


def routed(observations: Sequence[Observation], n_context: int) -> torch.Tensor:
    """`[layers, n_context]` bool on the CPU, beside the survival masks: the layer's full-cache attention routes
    through the token (see module doc)."""
    rows = [head_attention(obs)[:, :n_context].amax(dim=0) >= 1.0 / n_context for obs in observations]
    return torch.stack(rows).cpu()


def missed_evidence(survival: torch.Tensor, routes: torch.Tensor, evidence: torch.Tensor) -> bool:
    """Some evidence token is evicted by every kv-head of a layer that routes it."""
    if evidence.numel() == 0:
        return False
    gone = ~survival.any(dim=1)  # [layers, n]
    return bool((gone & routes)[:, evidence].any())


def span_states(survival: torch.Tensor, spans: Spans) -> tuple[bool, bool]:
    """`(some head evicts a whole span, some head keeps a span only in part)` over every (layer, kv-head)."""
    evicted = partial = False
    for start, end in spans:
        held = survival[..., start:end]
        evicted |= bool((~held.any(dim=-1)).any())
        partial |= bool((held.any(dim=-1) & ~held.all(dim=-1)).any())
    return evicted, partial


def attribute(missed: bool, misscored_margin: float | None, completed_margin: float | None) -> str:
    """The failure mode of one failure (see module doc); a check that did not apply is None."""
    if missed:
        return "missed"
    if misscored_margin is not None and misscored_margin > 0:
        return "mis-scored"
    if completed_margin is not None and completed_margin > 0:
        return "broken"
    return "unexplained"
