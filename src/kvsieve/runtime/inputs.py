"""Checks of what a user passes in: token ids and attention masks, with errors that name the problem."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..modeling.errors import UnhookableModelError


def check_model(model: object) -> None:
    """A clear error unless `model` is a `transformers` `PreTrainedModel`."""
    # imported here: `transformers.modeling_utils` costs most of a second to import, and a caller that holds a
    # model has loaded it already
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise UnhookableModelError(f"{type(model).__name__} is not a transformers PreTrainedModel")


def check_input_ids(model: torch.nn.Module, input_ids: torch.Tensor, what: str = "input_ids") -> None:
    """A clear error for ids that are not a `[batch, tokens]` LongTensor of the model's vocabulary."""
    check_model(model)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long or input_ids.ndim != 2:
        raise ValueError(f"{what} must be a LongTensor of shape [batch, tokens]")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"{what} is empty (shape {tuple(input_ids.shape)})")
    vocab = model.get_input_embeddings().num_embeddings
    bad = input_ids[(input_ids < 0) | (input_ids >= vocab)]
    if bad.numel():
        outside = bad.unique()[:8].tolist()
        raise ValueError(f"{what} holds token ids outside the model's vocabulary of {vocab}: {outside}")


def real_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """`[rows, n]` bool: the real tokens (1 in `attention_mask`), with a clear error for a bad mask."""
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.bool)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {shape}")
    real = attention_mask.to(device=input_ids.device).bool()
    empty = (~real.any(dim=1)).nonzero().flatten()
    if empty.numel():
        raise ValueError(f"sequence(s) {empty.tolist()} of the batch have no real token (attention_mask all 0)")
    return real


def protected_positions(positions: Sequence[int] | torch.Tensor | None, n_context: int) -> torch.Tensor | None:
    """`protect_positions` (a list or 1-D tensor of ints) as a LongTensor, each in [0, `n_context`), or a clear
    error that names the first position outside the context."""
    if positions is None:
        return None
    try:
        tensor = torch.as_tensor(positions)
    except (TypeError, ValueError, RuntimeError):
        tensor = None
    if tensor is not None and tensor.numel() == 0:
        return tensor.long().flatten()
    if (
        tensor is None
        or tensor.ndim != 1
        or tensor.is_floating_point()
        or tensor.is_complex()
        or tensor.dtype == torch.bool
    ):
        raise ValueError(f"protect_positions must be a list or 1-D tensor of token positions (ints), got {positions!r}")
    outside = tensor[(tensor < 0) | (tensor >= n_context)]
    if outside.numel():
        raise ValueError(
            f"protect_positions holds position {int(outside[0])}, outside the context of {n_context} tokens "
            f"(positions 0 to {n_context - 1}, counted over each sequence's real tokens)"
        )
    return tensor.long()
