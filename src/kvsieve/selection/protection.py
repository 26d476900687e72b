"""Protection: the entries no policy evicts (the first `n_sink`, the recent tail, caller-given positions)."""

from __future__ import annotations

import torch

from .observation import Observation

DEFAULT_N_SINK = 1
DEFAULT_SLIDING_WINDOW = 32


def protected_mask(
    obs: Observation, n_sink: int, sliding_window: int, protect_positions: torch.Tensor | None = None
) -> torch.Tensor:
    """`[kv_heads, n]` bool: each head's first `n_sink` and last `sliding_window` entries, and the given positions."""
    valid = obs.valid_mask
    rank = valid.cumsum(dim=-1) - 1
    count = valid.sum(dim=-1, keepdim=True)
    mask = (rank < n_sink) | (rank >= count - sliding_window)
    if protect_positions is not None:
        mask |= torch.isin(obs.positions, protect_positions.to(obs.positions.device))
    return mask & valid


def question_protection(n_context: int, n_question: int, sliding_window: int) -> torch.Tensor:
    """Positions protected in question-aware compression: the question and the context's own recent window.

    Protecting the context's last `sliding_window` tokens as the agnostic case does makes both
    modes evict the same number of context entries.
    """
    return torch.arange(max(0, n_context - sliding_window), n_context + n_question)
