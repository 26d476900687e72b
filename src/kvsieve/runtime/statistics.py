"""What every observation of a layer states, read from the model: softmax scale, query heads, `W_o`, gates."""

from __future__ import annotations

import torch

from ..selection.checkpoint import load_gates
from ..selection.gates import RetentionGates
from ..selection.observation import Needs, Statistics


def needed_gates(model: torch.nn.Module, needs: Needs) -> dict[str, RetentionGates]:
    """The retention gates `needs` names, loaded and checked against `model`."""
    return {source: load_gates(source, model) for source in needs.gates}


def output_projection(module: torch.nn.Module) -> torch.Tensor:
    """The attention output projection weight `[hidden, q_heads * head_dim]`, or a clear error."""
    projection = getattr(module, "o_proj", None)
    if not isinstance(projection, torch.nn.Linear):
        raise ValueError(f"{type(module).__name__} has no output projection (o_proj), which the scorer needs")
    return projection.weight.detach()


def layer_statistics(model: torch.nn.Module, needs: Needs | None = None) -> list[Statistics]:
    """Per layer (sliding-window ones included), what every observation states (softmax scale, query heads)
    and the output projection and retention gates if needed."""
    needs = Needs() if needs is None else needs
    gates = needed_gates(model, needs)
    return [
        Statistics(
            scaling=layer.self_attn.scaling,
            q_heads=layer.self_attn.config.num_attention_heads,
            output_weight=output_projection(layer.self_attn) if needs.output_projection else None,
            gates=gates,
        )
        for layer in model.base_model.layers
    ]
