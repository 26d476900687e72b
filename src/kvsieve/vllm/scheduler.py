"""vLLM's scheduler giving back the blocks kvsieve emptied, keeping prefix caching true, and tracing the KV blocks in
use step by step."""

from __future__ import annotations

import json
import math
import time

from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler

from .settings import CONFIG_KEY, PluginSettings

logger = init_logger(__name__)
#: What `num_cached_block` reads for a compacted request: every block counts as cached, so vLLM hashes none of it.
NEVER_CACHED = 1 << 62


class SieveScheduler(Scheduler):
    """Tells the worker which of every request's first blocks are a shared prefix (never rewritten), and after each
    step frees the blocks kvsieve emptied behind that prefix (replaced by the null block, as vLLM frees the blocks a
    sliding window has passed, so counts by true position stay right).

    Prefix caching stays true: a block shared with another request, or found in the prefix cache when the request
    was admitted, belongs to the shared prefix; a compacted request's other blocks leave the prefix cache and are
    never hashed again (they no longer hold the tokens their position would say). Blocks it frees before any
    compaction rewrote them keep their hash and their entries, so later requests may still find them.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kvsieve = PluginSettings.parse(self.vllm_config.additional_config[CONFIG_KEY])
        self.kvsieve_freed = 0
        self.kvsieve_hits: dict[str, int] = {}  # request -> prefix-cache hit (whole blocks) when it was admitted
        self.kvsieve_shared: dict[str, int] = {}  # request -> shared prefix (tokens) of its compaction
        bounded = f", re-scored every {self.kvsieve.buffer} new tokens" if self.kvsieve.bounded else ""
        logger.info("kvsieve evicts with %s under %s%s", self.kvsieve.policy.name, self.kvsieve.budget, bounded)

    def schedule(self, *args, **kwargs):
        output = super().schedule(*args, **kwargs)
        for new in output.scheduled_new_reqs:
            self.kvsieve_hits[new.req_id] = new.num_computed_tokens // self.block_size
        output.kvsieve_shared = {
            req_id: self.shared_prefix(req_id) for req_id in output.num_scheduled_tokens if req_id in self.requests
        }
        return output

    def shared_prefix(self, req_id: str) -> int:
        """Tokens of the request's first blocks that are, or may become, another request's prefix: blocks it found
        in the prefix cache when admitted, and blocks another request holds now (fixed at its first compaction)."""
        if req_id in self.kvsieve_shared:
            return self.kvsieve_shared[req_id]
        (manager,) = self.kv_cache_manager.coordinator.single_type_managers
        blocks = manager.req_to_blocks.get(req_id, [])
        hits, shared = self.kvsieve_hits.get(req_id, 0), 0
        while shared < len(blocks) and (shared < hits or blocks[shared].ref_cnt > 1):
            shared += 1
        return shared * manager.block_size

    def update_from_output(self, scheduler_output, model_runner_output):
        compacted = getattr(model_runner_output, "kvsieve_evicted", None) or {}
        held = []
        for req_id, (evicted, mean) in compacted.items():
            blocks = self.free_evicted(req_id, evicted, scheduler_output.kvsieve_shared.get(req_id, 0))
            held.append({"blocks": blocks, "ideal": math.ceil(mean / self.block_size)})
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for req_id in (self.kvsieve_hits.keys() | self.kvsieve_shared.keys()) - self.requests.keys():
            self.forget(req_id)  # finished or aborted
        for req_id in scheduler_output.preempted_req_ids or ():
            self.forget(req_id)  # it starts over when resumed
        if self.kvsieve.trace:
            self._trace(scheduler_output, held)
        return outputs

    def free_evicted(self, req_id: str, evicted: int, shared: int) -> int:
        """Give back the whole blocks among the `evicted` positions behind a request's shared prefix, take its other
        blocks out of the prefix cache and stop vLLM from hashing any more of them; the blocks it holds now."""
        pool = self.kv_cache_manager.block_pool
        before = pool.get_num_free_blocks()
        for manager in self.kv_cache_manager.coordinator.single_type_managers:
            first = shared // manager.block_size
            manager._remove_blocks_in_range(req_id, first, first + evicted // manager.block_size)
            rewritten = {block.block_id for block in manager.req_to_blocks.get(req_id, [])[first:] if not block.is_null}
            pool.evict_blocks(rewritten)
            manager.num_cached_block[req_id] = NEVER_CACHED
        self.kvsieve_shared[req_id] = shared
        self.kvsieve_freed += pool.get_num_free_blocks() - before
        return sum(not block.is_null for block in manager.req_to_blocks.get(req_id, []))

    def forget(self, req_id: str) -> None:
        self.kvsieve_hits.pop(req_id, None)
        self.kvsieve_shared.pop(req_id, None)

    def blocks_in_use(self) -> int:
        """KV blocks held by requests (the null block aside)."""
        pool = self.kv_cache_manager.block_pool
        return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()

    def _trace(self, scheduler_output, compacted: list[dict]) -> None:
        """One line a step; `compacted`: the blocks each request compacted in it holds and its mean count needs."""
        line = {
            "time": time.time(),
            "running": len(self.running),
            "waiting": len(self.waiting),
            "blocks_in_use": self.blocks_in_use(),
            "blocks_freed": self.kvsieve_freed,
            "preempted": len(scheduler_output.preempted_req_ids or ()),
            "tokens": scheduler_output.total_num_scheduled_tokens,
            "compacted": compacted,
        }
        with open(self.kvsieve.trace, "a") as file:
            file.write(json.dumps(line) + "\n")
