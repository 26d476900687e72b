"""What a model's architecture says about its cache: its decoder layers and their attention modules, the
kv-heads and head dimension of its entries, and which layers attend fully or keep a sliding window.

Models such as Gemma-3 mix full-attention layers with sliding-window layers (`config.layer_types`);
Mistral with `sliding_window` set makes every layer a sliding one. Policies score and evict the
full-attention layers only; a sliding layer's cache keeps its own rolling window. The families
`transformers` runs through its attention interface share this shape: `model.base_model.layers`,
each with its attention module (`self_attn`; GPT-NeoX: `attention`), which carries `layer_idx`
and `scaling`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

from .errors import UnhookableModelError

#: What `transformers` calls a decoder layer's attention module (Llama, Qwen, Mistral, Phi-3, OLMo-2, Granite,
#: Gemma: `self_attn`; GPT-NeoX: `attention`).
ATTENTION_ATTRIBUTES = ("self_attn", "attention")

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


def layer_windows(model: PreTrainedModel) -> list[int | None]:
    """Per decoder layer, its sliding window (None for full attention), as `transformers`' `DynamicCache` decides.

    Raises `UnhookableModelError` naming what sieve attention cannot serve: chunked attention,
    other layer types, attention logit soft-capping, bidirectional attention.
    """
    name = type(model).__name__
    config = model.config.get_text_config(decoder=True)
    window = getattr(config, "sliding_window", None)
    layer_types = (
        getattr(config, "layer_types", None)
        or [SLIDING_ATTENTION if window else FULL_ATTENTION] * config.num_hidden_layers
    )
    unknown = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if "chunked_attention" in unknown:
        chunk = getattr(config, "attention_chunk_size", None)
        raise UnhookableModelError(
            f"{name} uses chunked attention layers (attention_chunk_size={chunk}), which sieve attention does not "
            "serve; full-attention and sliding-window layers are supported"
        )
    if unknown:
        raise UnhookableModelError(
            f"{name} has layer types {unknown}, which sieve attention does not serve; "
            "full-attention and sliding-window layers are supported"
        )
    if SLIDING_ATTENTION in layer_types and not window:
        raise UnhookableModelError(f"{name} declares sliding-window layers but no sliding_window size")
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise UnhookableModelError(
            f"{name} soft-caps its attention logits (attn_logit_softcapping={softcap}, as Gemma-2 does), which "
            "sieve attention does not serve"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise UnhookableModelError(f"{name} uses bidirectional attention; sieve attention serves causal models")
    return [window if kind == SLIDING_ATTENTION else None for kind in layer_types]


def decoder_layers(model: PreTrainedModel) -> list[nn.Module]:
    """The decoder layers of `model`, in order, or a clear error."""
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UnhookableModelError(
            f"{type(model).__name__} has no decoder layers kvsieve recognises (base_model.layers)"
        )
    return list(layers)


def attention_module(layer: nn.Module) -> nn.Module:
    """A decoder layer's attention module (the one `transformers` hands to attention functions)."""
    for name in ATTENTION_ATTRIBUTES:
        module = getattr(layer, name, None)
        if isinstance(module, nn.Module):
            return module
    raise UnhookableModelError(
        f"{type(layer).__name__} has no attention module kvsieve recognises ({', '.join(ATTENTION_ATTRIBUTES)})"
    )


#: What `transformers` calls an attention module's output projection (GPT-NeoX: `dense`).
OUTPUT_PROJECTIONS = ("o_proj", "dense")


def output_projection(module: nn.Module) -> Tensor:
    """The attention output projection weight `[hidden, q_heads * head_dim]`, or a clear error."""
    for name in OUTPUT_PROJECTIONS:
        projection = getattr(module, name, None)
        if isinstance(projection, nn.Linear):
            return projection.weight.detach()
    names = " or ".join(OUTPUT_PROJECTIONS)
    raise ValueError(f"{type(module).__name__} has no output projection ({names}), which the scorer needs")


def kv_geometry(model: PreTrainedModel) -> tuple[int, int]:
    """`(kv_heads, head_dim)` of the model's entries, as `transformers`' attention modules derive them."""
    config = model.config.get_text_config(decoder=True)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return kv_heads, head_dim
