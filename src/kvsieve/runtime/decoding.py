"""Decoding from a compressed prompt: the one path `kvsieve.generate` and `apply` share."""

from __future__ import annotations

import torch

from ..selection.errors import PolicyError
from ..selection.policy import Policy
from .cache import SievedCache
from .compress import compress


def compress_prompt(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    policy: str | Policy,
    rate: float | None = None,
    question_ids: torch.Tensor | None = None,
    **budget: int | None,
) -> SievedCache:
    """`compress` every token of a prompt but the last, which `generate` then feeds first.

    The prompt is `input_ids`, followed by `question_ids` if given: then the compression is
    question-aware (the question is protected, also while a size budget holds during generation).
    `budget`: `max_tokens`, `max_bytes` and `buffer`, as for `compress`.
    """
    if question_ids is not None and question_ids.shape[-1] > 1:
        question = question_ids[:, :-1]
        return compress(model, input_ids, policy, rate, attention_mask=attention_mask, question_ids=question, **budget)
    if question_ids is not None:  # a one-token question is the token `generate` feeds first
        input_ids, attention_mask = prompt_with_question(input_ids, attention_mask, question_ids)
    context_mask = None if attention_mask is None else attention_mask[:, :-1]
    return compress(model, input_ids[:, :-1], policy, rate, attention_mask=context_mask, **budget)


def prompt_with_question(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, question_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The whole prompt `generate` reads: the context, then the question (and the mask extended over it)."""
    ids = torch.cat([input_ids, question_ids.to(input_ids.device)], dim=-1)
    if attention_mask is None:
        return ids, None
    return ids, torch.cat([attention_mask, torch.ones_like(question_ids, device=attention_mask.device)], dim=-1)


def refuse_beams(model: torch.nn.Module, generate_kwargs: dict, what: str) -> None:
    """A clear error if `generate` would run beam search (asked for, or the model's generation config)."""
    if int(generate_kwargs.get("num_beams") or model.generation_config.num_beams or 1) > 1:
        raise PolicyError(f"beam search cannot run on {what}; use greedy decoding or sampling")
