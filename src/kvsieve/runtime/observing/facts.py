"""What the model fixes about every layer, read from it: softmax scale, query heads, `W_o`, retention gates."""

from __future__ import annotations

import torch

from ...modeling.architecture import attention_module, decoder_layers, output_projection
from ...modeling.gates import RetentionGates
from ...selection.checkpoint import load_gates
from ...selection.merge import recorded_merge_needs
from ...selection.observation import LayerFacts, Needs


def needed_gates(model: torch.nn.Module, needs: Needs) -> dict[str, RetentionGates]:
    """The retention gates `needs` names, loaded and checked against `model`."""
    return {source: load_gates(source, model) for source in needs.gates}


def recorded_needs(facts: list[LayerFacts]) -> Needs:
    """What the merges recorded in the checkpoints of the loaded gates read (a policy naming no merge folds with
    its gates' one, `Policy.merged`), so that one prefill records it too."""
    return recorded_merge_needs(facts[0].gates.values() if facts else ())


def layer_facts(model: torch.nn.Module, needs: Needs | None = None) -> list[LayerFacts]:
    """Per layer (sliding-window ones included): softmax scale and query heads, and the output projection and
    retention gates if `needs` says so."""
    needs = Needs() if needs is None else needs
    gates = needed_gates(model, needs)
    q_heads = model.config.get_text_config(decoder=True).num_attention_heads
    modules = [attention_module(layer) for layer in decoder_layers(model)]
    return [
        LayerFacts(
            scaling=module.scaling,
            q_heads=q_heads,
            output_weight=output_projection(module) if needs.output_projection else None,
            gates=gates,
        )
        for module in modules
    ]
