"""kvsieve inside vLLM: evict after the prefill (and while generating, holding a size), give the blocks back.

vLLM finds the plugin through its ``vllm.general_plugins`` entry point (`register`, run in every vLLM
process); an engine whose `additional_config` has a ``"kvsieve"`` entry turns it on:

    LLM(model=..., additional_config={"kvsieve": {"policy": "snapkv", "rate": 0.75}})

The scoring is `kvsieve.selection`'s, the same as `kvsieve.compress`'s; this package is the second
runtime beside `kvsieve.runtime` and imports neither it nor the harness. See `docs/vllm.md`.
"""

from __future__ import annotations

from .engine import SUPPORTED_VLLM

BACKEND = "kvsieve.vllm.backend.SieveAttentionBackend"


def register() -> None:
    """vLLM's general-plugin entry point: install the engine defaults and kvsieve's CPU attention backend.

    Cheap and idempotent; an unsupported vLLM release is left alone until an engine asks for kvsieve, which
    is then a clear error.
    """
    import vllm

    from .engine import install_engine_defaults

    install_engine_defaults()
    if vllm.__version__ not in SUPPORTED_VLLM:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)


__all__ = ["BACKEND", "SUPPORTED_VLLM", "register"]
