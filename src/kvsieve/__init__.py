"""kvsieve: decide which KV-cache entries a transformers model keeps, evict the rest for real, measure the cost."""

from .apply import EvictionConfig, SieveHandle, apply, compress
from .attention import UnhookableModelError, UnsupportedAttentionError, enable_sieve_attention
from .cache import SievedCache
from .models import ModelNotFoundError, load_model
from .observe import Observation, Prefill, observe_prefill
from .policy import Policy, PolicyError, known_policies, make_policy

__version__ = "0.1.0"

__all__ = [
    "EvictionConfig",
    "ModelNotFoundError",
    "Observation",
    "Policy",
    "PolicyError",
    "Prefill",
    "SieveHandle",
    "SievedCache",
    "UnhookableModelError",
    "UnsupportedAttentionError",
    "__version__",
    "apply",
    "compress",
    "enable_sieve_attention",
    "known_policies",
    "load_model",
    "make_policy",
    "observe_prefill",
]
