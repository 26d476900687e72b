"""vLLM's scheduler giving back the blocks kvsieve emptied, and tracing the KV blocks in use step by step."""

from __future__ import annotations

import json
import time

from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler

from .settings import CONFIG_KEY, PluginSettings

logger = init_logger(__name__)


class SieveScheduler(Scheduler):
    """After each step, frees the blocks in front of every request's compacted entries (as vLLM frees the blocks a
    sliding window has passed: replaced by the null block, so counts by true position stay right)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kvsieve = PluginSettings.parse(self.vllm_config.additional_config[CONFIG_KEY])
        self.kvsieve_freed = 0
        bounded = f", re-scored every {self.kvsieve.buffer} new tokens" if self.kvsieve.bounded else ""
        logger.info("kvsieve evicts with %s under %s%s", self.kvsieve.policy.name, self.kvsieve.budget, bounded)

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for req_id, evicted in (getattr(model_runner_output, "kvsieve_evicted", None) or {}).items():
            self.free_evicted(req_id, evicted)
        if self.kvsieve.trace:
            self._trace(scheduler_output)
        return outputs

    def free_evicted(self, req_id: str, evicted: int) -> None:
        """Give back the whole blocks among a request's first `evicted` positions."""
        pool = self.kv_cache_manager.block_pool
        before = pool.get_num_free_blocks()
        for manager in self.kv_cache_manager.coordinator.single_type_managers:
            manager._remove_blocks_in_range(req_id, 0, evicted // manager.block_size)
        self.kvsieve_freed += pool.get_num_free_blocks() - before

    def blocks_in_use(self) -> int:
        """KV blocks held by requests (the null block aside)."""
        pool = self.kv_cache_manager.block_pool
        return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()

    def _trace(self, scheduler_output) -> None:
        line = {
            "time": time.time(),
            "running": len(self.running),
            "waiting": len(self.waiting),
            "blocks_in_use": self.blocks_in_use(),
            "blocks_freed": self.kvsieve_freed,
            "preempted": len(scheduler_output.preempted_req_ids or ()),
            "tokens": scheduler_output.total_num_scheduled_tokens,
        }
        with open(self.kvsieve.trace, "a") as file:
            file.write(json.dumps(line) + "\n")
