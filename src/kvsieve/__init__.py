"""kvsieve: decide which KV-cache entries a transformers model keeps, evict the rest for real, measure the cost."""

from .apply import EvictionConfig, SieveHandle, apply, bounded_cache, compress
from .attention import UnhookableModelError, UnsupportedAttentionError, sieve_attention
from .budget import MaxBytes, MaxTokens, Rate
from .cache import RaggedAttentionError, SievedCache
from .errors import PolicyError
from .generation import generate
from .models import ModelNotFoundError, load_model
from .observe import Needs, Observation, Prefill, observe_cache, observe_prefill
from .policy import Policy, known_policies, make_policy
from .spans import sentence_spans

__version__ = "0.1.0"

__all__ = [
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
    "UnhookableModelError",
    "UnsupportedAttentionError",
    "__version__",
    "apply",
    "bounded_cache",
    "compress",
    "generate",
    "known_policies",
    "load_model",
    "make_policy",
    "observe_cache",
    "observe_prefill",
    "sentence_spans",
    "sieve_attention",
]
