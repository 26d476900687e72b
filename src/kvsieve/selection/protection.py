"""Protection: the entries no policy evicts (the first `n_sink`, the last `n_recent`, caller-given positions)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .observation import Observation

#: Entries at the start of every head that are never evicted (the attention sink, BOS).
DEFAULT_N_SINK = 1
#: The most recent entries of every head that are never evicted.
DEFAULT_N_RECENT = 32
PROTECTION_DEFAULTS = {"n_sink": DEFAULT_N_SINK, "n_recent": DEFAULT_N_RECENT}


def protected_mask(
    obs: Observation, n_sink: int, n_recent: int, protect_positions: Sequence[int] | torch.Tensor | None = None
) -> torch.Tensor:
    """`[kv_heads, n]` bool: each head's first `n_sink` and last `n_recent` entries, and the given positions."""
    valid = obs.valid_mask
    rank = valid.cumsum(dim=-1) - 1
    count = valid.sum(dim=-1, keepdim=True)
    mask = (rank < n_sink) | (rank >= count - n_recent)
    if protect_positions is not None:
        mask |= torch.isin(obs.positions, torch.as_tensor(protect_positions, device=obs.positions.device))
    return mask & valid


def question_protection(n_context: int, n_question: int, n_recent: int) -> torch.Tensor:
    """Positions protected in question-aware compression: the question and the context's own recent tail.

    Protecting the context's last `n_recent` tokens as the agnostic case does makes both modes
    evict the same number of context entries.
    """
    return torch.arange(max(0, n_context - n_recent), n_context + n_question)
