"""The worker process's kvsieve state, which the attention backend reaches (vLLM builds it with no handle to us)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .compaction import WorkerSieve

_CURRENT: WorkerSieve | None = None


def current() -> WorkerSieve | None:
    """This process's kvsieve worker state (None when the engine runs without kvsieve)."""
    return _CURRENT


def install(sieve: WorkerSieve | None) -> None:
    global _CURRENT
    _CURRENT = sieve
