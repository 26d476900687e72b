"""kvsieve: decide which KV-cache entries a transformers model keeps, evict the rest for real, measure the cost.

Four layers, each a package: `kvsieve.modeling` (what is read from a model: its layers, rotary embedding,
weights hash, the gate network), `kvsieve.selection` (which entries to keep, from observations alone),
`kvsieve.runtime` (the cache, sieve attention, prefill and generation) and `kvsieve.harness` (models,
data, evaluation, reports, training, the CLI). `import kvsieve` loads the first three; `load_model`
loads the harness's model loader when it is first called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .modeling.errors import UnhookableModelError
from .runtime.api.apply import SieveHandle, UncompressedForwardWarning, apply
from .runtime.api.compress import bounded_cache, compress
from .runtime.api.config import EvictionConfig
from .runtime.api.evictions import Eviction, evictions
from .runtime.api.generation import generate
from .runtime.attention.sieve import UnsupportedAttentionError, sieve_attention
from .runtime.compat import UnsupportedTransformersError, cache_argument
from .runtime.observing.cache_observations import observe_cache
from .runtime.observing.prefill import Prefill, observe_prefill
from .runtime.storage.cache import RaggedAttentionError, SievedCache
from .selection.budget import MaxBytes, MaxTokens, Rate
from .selection.errors import PolicyError
from .selection.observation import Needs, Observation
from .selection.policy import Policy
from .selection.spans import sentence_spans
from .selection.spec import known_policies, make_policy

if TYPE_CHECKING:
    from .harness.models import ModelNotFoundError, load_model

__version__ = "0.3.0"

#: Public names that live in the harness, imported when first used.
_LAZY = {"load_model": "kvsieve.harness.models", "ModelNotFoundError": "kvsieve.harness.models"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvsieve' has no attribute {name!r}")


__all__ = [
    "Eviction",
    "EvictionConfig",
    "MaxBytes",
    "MaxTokens",
    "ModelNotFoundError",
    "Needs",
    "Observation",
    "Policy",
    "PolicyError",
    "Prefill",
    "RaggedAttentionError",
    "Rate",
    "SieveHandle",
    "SievedCache",
    "UncompressedForwardWarning",
    "UnhookableModelError",
    "UnsupportedAttentionError",
    "UnsupportedTransformersError",
    "__version__",
    "apply",
    "bounded_cache",
    "cache_argument",
    "compress",
    "evictions",
    "generate",
    "known_policies",
    "load_model",
    "make_policy",
    "observe_cache",
    "observe_prefill",
    "sentence_spans",
    "sieve_attention",
]
