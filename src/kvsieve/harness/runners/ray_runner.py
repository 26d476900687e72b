"""Cells on a Ray cluster: model replicas as actors, each loading the model once (this module imports Ray).

`RayRunner(ModelChoice(...), address="auto")` connects to a running cluster (``"auto"`` on one of its
nodes, or ``"host:port"``; Ray deprecates Ray Client's ``"ray://"`` addresses, which need `ray[client]`:
submit the command with Ray's Jobs API instead) or starts one on this machine (``"local"``), starts
`workers` actors that each load the model from its `ModelChoice` (one per GPU where the model runs
on CUDA, else one per node; `cpus_per_worker` cores and torch threads each), and hands them cells.
Results come back in the cells' order, so a log written from them reads as a local run's.

Faults: an actor whose process dies is restarted by Ray (its model loaded again) and the cells it
held are run again (`max_restarts`/`max_task_retries` unbounded); a cell's result reaches the
driver once, whichever attempt made it. Every node must have kvsieve, and the model, installed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from ..models import ModelChoice
from .protocol import C, R, Work

#: Where `RayRunner` starts a cluster of its own instead of connecting to one.
LOCAL = "local"
#: Cells handed to an actor before it asks for more (the next one waits there while one runs).
CELLS_PER_WORKER = 2


class ReplicaWorker:
    """A model replica: loads the model once, then does cells (a Ray actor; `RayRunner` starts it)."""

    def __init__(self, choice: ModelChoice, threads: int) -> None:
        torch.set_num_threads(threads)
        self.model, self.tokenizer = choice.load()

    def pid(self) -> int:
        return os.getpid()

    def run(self, work: Work[C, R], cell: C) -> R:
        return work(self.model, self.tokenizer, cell)


@dataclass(frozen=True)
class Placement:
    """How many replicas, and what each holds: CPU cores (its torch threads) and GPUs."""

    workers: int
    cpus: int
    gpus: int


def place(
    choice: ModelChoice, nodes: Sequence[dict[str, float]], workers: int | None, cpus_per_worker: int | None
) -> Placement:
    """Replicas for the alive `nodes` (their resources): by default one per GPU when the model runs on CUDA, else
    one per node, sharing the cluster's cores evenly; a clear error when the cluster cannot hold what was asked."""
    cpus, gpus = sum(n.get("CPU", 0) for n in nodes), sum(n.get("GPU", 0) for n in nodes)
    per_gpu = int(choice.device.type == "cuda")
    if per_gpu and gpus < 1:
        raise ValueError(f"the model runs on {choice.device}, but the Ray cluster has no GPU")
    workers = workers or (int(gpus) if per_gpu else len(nodes))
    cpus_per_worker = cpus_per_worker or max(1, int(cpus // workers))
    if workers < 1 or cpus_per_worker < 1:
        raise ValueError(f"workers and CPUs per worker must be >= 1, got {workers} and {cpus_per_worker}")
    if workers * cpus_per_worker > cpus:
        need = workers * cpus_per_worker
        raise ValueError(f"{workers} workers x {cpus_per_worker} CPUs need {need}; the Ray cluster has {cpus:g}")
    if workers * per_gpu > gpus:
        raise ValueError(f"{workers} workers need a GPU each; the Ray cluster has {gpus:g}")
    return Placement(workers, cpus_per_worker, per_gpu)


@dataclass
class RayRunner:
    """Runs cells on model replicas on a Ray cluster (module doc); use it as a context manager.

    Args:
        model: what every replica loads (a CUDA device means one GPU per replica, its own).
        address: ``"local"`` (a cluster on this machine, unless Ray is already initialised here),
            ``"auto"`` or ``"host:port"``.
        workers: replicas (default: one per GPU for a CUDA model, else one per node).
        cpus_per_worker: cores, and torch threads, of each replica (default: its share of the cluster).
    """

    model: ModelChoice
    address: str = LOCAL
    workers: int | None = None
    cpus_per_worker: int | None = None
    placement: Placement | None = field(default=None, init=False)
    _actors: list[Any] = field(default_factory=list, init=False, repr=False)
    _owns_ray: bool = field(default=False, init=False, repr=False)

    def __enter__(self) -> RayRunner:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Connect (or start a local cluster) and start the replicas; waits until every one has loaded the model."""
        if not ray.is_initialized():
            local = self.address == LOCAL
            options = {"num_cpus": os.cpu_count(), "include_dashboard": False} if local else {}
            ray.init(address=self.address, logging_level=logging.WARNING, **options)
            self._owns_ray = True
        nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
        try:
            self.placement = place(self.model, nodes, self.workers, self.cpus_per_worker)
        except ValueError:
            self.stop()
            raise
        replica = self.model.on(torch.device("cuda", 0)) if self.placement.gpus else self.model
        actor = ray.remote(ReplicaWorker).options(
            num_cpus=self.placement.cpus, num_gpus=self.placement.gpus, max_restarts=-1, max_task_retries=-1
        )
        self._actors = [actor.remote(replica, self.placement.cpus) for _ in range(self.placement.workers)]
        self.worker_pids()

    def worker_pids(self) -> list[int]:
        """The process id of every replica (waits for them to be up)."""
        return _get([a.pid.remote() for a in self._actors])

    def stop(self) -> None:
        """Stop the replicas, and the cluster or connection this runner opened."""
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    def map(self, work: Work[C, R], cells: Sequence[C]) -> Iterator[R]:
        """`work` on every cell, `CELLS_PER_WORKER` queued on each replica; the results in the cells' order."""
        if not self._actors:
            raise RuntimeError("RayRunner is not started: use it as `with RayRunner(...) as runner:`")
        shared = ray.put(work)
        queue = iter(enumerate(cells))
        running: dict[Any, tuple[int, Any]] = {}
        finished: dict[int, R] = {}

        def hand(actor: Any) -> None:
            job = next(queue, None)
            if job is not None:
                running[actor.run.remote(shared, job[1])] = (job[0], actor)

        for actor in self._actors * CELLS_PER_WORKER:
            hand(actor)
        following = 0
        while running:
            (ready,), _ = ray.wait(list(running), num_returns=1)
            index, actor = running.pop(ready)
            finished[index] = _get(ready)
            hand(actor)
            while following in finished:
                yield finished.pop(following)
                following += 1


def _get(refs: Any) -> Any:
    """`ray.get`, raising a cell's own error (e.g. a `ValueError` naming the problem) rather than Ray's wrapper."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as err:
        raise err.as_instanceof_cause() from None
