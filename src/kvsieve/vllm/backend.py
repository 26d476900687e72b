"""vLLM's CPU attention backend with kvsieve inside: the same kernels, on the cache kvsieve compacted.

Registered over vLLM's ``CPU_ATTN`` backend by the plugin entry point. With no kvsieve settings in
the engine's `additional_config` the builder and the attention are exactly vLLM's.
"""

from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from ..selection.observation import LayerFacts
from . import worker_state
from .compaction import layer_index


class SieveMetadataBuilder(CPUAttentionMetadataBuilder):
    """Plans each step for kvsieve and points compacted requests at their compacted cache.

    Built after the worker loaded the model, so it holds that worker's kvsieve state (None: kvsieve is off)
    and hands it to the attention layers with each step's plan.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sieve = worker_state.current()

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        plan = None
        if self.sieve is not None:
            plan = self.sieve.plan(common_attn_metadata, self.block_size, len(self.layer_names))
        if plan is not None:
            common_attn_metadata = plan.remap(common_attn_metadata)
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        metadata.kvsieve = None if plan is None else (self.sieve, plan)
        return metadata


class SieveAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, kvsieve's attention for the requests whose cells vLLM's kernel cannot read, then
    kvsieve's recording and compaction for the layer."""

    kvsieve_facts: LayerFacts | None = None  # what the model fixes about the layer, once kvsieve first sees it

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        step = getattr(attn_metadata, "kvsieve", None)
        if step is not None:
            sieve, plan = step
            layer_idx = layer_index(layer.layer_name)
            if self.kvsieve_facts is None:
                weight = sieve.output_weights.get(layer_idx)
                self.kvsieve_facts = LayerFacts(self.scale, self.num_heads, output_weight=weight, gates=sieve.gates)
            sieve.caches[layer_idx] = kv_cache
            sieve.layout.check(layer, self.kv_cache_dtype, kv_cache)
            sieve.attend(layer_idx, self.kvsieve_facts, query, output, plan)
            sieve.after_attention(layer_idx, self.kvsieve_facts, query, output, plan)
        return output


class SieveAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with kvsieve's builder and attention."""

    @staticmethod
    def get_builder_cls():
        return SieveMetadataBuilder

    @staticmethod
    def get_impl_cls():
        return SieveAttentionImpl
