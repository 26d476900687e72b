"""What a model's architecture says about its cache: which layers attend fully and which keep a sliding window.

Models such as Gemma-3 mix full-attention layers with sliding-window layers (`config.layer_types`);
Mistral with `sliding_window` set makes every layer a sliding one. Policies score and evict the
full-attention layers only; a sliding layer's cache keeps its own rolling window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import UnhookableModelError

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
