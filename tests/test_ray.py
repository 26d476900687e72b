"""The harness on Ray: real clusters (one started in this process, two nodes started by `ray start`),
the rows a local run makes, and the faults a sweep must survive (a worker or the driver killed)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from extras import require

ray = require("ray", "ray")

from kvsieve.harness.data.suites import task_samples
from kvsieve.harness.eval import run_ppl
from kvsieve.harness.eval.contract_diagnostic import run_diagnostic
from kvsieve.harness.eval.methods import KvsievePolicy
from kvsieve.harness.eval.results_log import read_rows
from kvsieve.harness.eval.streaming import run_streaming
from kvsieve.harness.eval.sweep import SurvivalCell, row_key, run_sweep, sample_survival
from kvsieve.harness.models import ModelChoice
from kvsieve.harness.report.html import MANIFEST_FILE, RESULTS_FILE
from kvsieve.harness.runners import LocalRunner, Work, run_once
from kvsieve.harness.runners.ray_runner import RayRunner, place
from kvsieve.selection.errors import PolicyError
from kvsieve.selection.spec import make_policy
from tokenizer import VOCAB_SIZE

TASKS, LENGTH, POLICIES, RATES, MODES = "niah_single_1,base", 384, "snapkv,random", [0.5, 0.9], ("agnostic", "aware")
RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture(scope="module")
def choice(model_dir: Path) -> ModelChoice:
    return ModelChoice(str(model_dir))


@pytest.fixture(scope="module")
def here(choice: ModelChoice) -> LocalRunner:
    return LocalRunner(*choice.load())


@pytest.fixture(scope="module")
def samples(here: LocalRunner) -> list:
    return task_samples(TASKS, here.tokenizer, length=LENGTH, n=2, seed=0)


@pytest.fixture(scope="module")
def local_rows(here: LocalRunner, samples: list) -> pd.DataFrame:
    with torch.no_grad():
        return run_sweep(here, samples, POLICIES, RATES, MODES)


@pytest.fixture(scope="module")
def replicas(choice: ModelChoice) -> Iterator[RayRunner]:
    """Two replicas of one CPU each on a local cluster of two CPUs, started here."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    try:
        with RayRunner(choice, workers=2, cpus_per_worker=1) as runner:
            yield runner
    finally:
        ray.shutdown()


def assert_same_rows(got: pd.DataFrame, want: pd.DataFrame) -> None:
    """The same rows in the same order, timings aside (floats to float32 rounding: a replica's own threads)."""
    timings = [column for column in want.columns if column.endswith("seconds")]
    got, want = got.drop(columns=timings), want.drop(columns=timings)
    assert list(got.columns) == list(want.columns) and len(got) == len(want)
    for column in got.columns:
        mine, theirs = [_plain(v) for v in got[column]], [_plain(v) for v in want[column]]  # Parquet reads arrays
        if pd.api.types.is_float_dtype(want[column]):
            np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6, err_msg=column)
        else:
            assert mine == theirs, column


def _plain(value: object) -> object:
    return value.tolist() if isinstance(value, np.ndarray) else value


def test_sweep_rows_on_ray_equal_a_local_runs(replicas, samples, local_rows, tmp_path):
    path = tmp_path / "results.jsonl"
    rows = run_sweep(replicas, samples, POLICIES, RATES, MODES, results=path)
    assert_same_rows(rows, local_rows)
    assert_same_rows(pd.DataFrame(read_rows(path)), local_rows)  # written once each, in the cells' order
    assert_same_rows(pd.read_parquet(path.with_suffix(".parquet")), local_rows)
    assert local_rows["gold_logprob"].nunique() > len(local_rows) // 2  # rows that differ, so an order could fail


@torch.no_grad()
def test_diagnostic_ppl_and_streaming_on_ray_equal_local_runs(replicas, here, samples):
    diagnostic = [run_diagnostic(r, samples[:2], ["knorm", "random"], [0.75], MODES) for r in (replicas, here)]
    assert_same_rows(*diagnostic)

    generator = torch.Generator().manual_seed(0)
    documents = [(f"doc{i}", torch.randint(0, VOCAB_SIZE, (1, 89), generator=generator)) for i in range(3)]
    ppl = [run_ppl(r, documents, ["importance", "random"], [0.5, 0.9], 64, 24) for r in (replicas, here)]
    assert ppl[0].nll.keys() == ppl[1].nll.keys() and ppl[0].kv_bytes == ppl[1].kv_bytes
    for key in ppl[1].nll:
        np.testing.assert_allclose(ppl[0].nll[key], ppl[1].nll[key], rtol=1e-5)
    np.testing.assert_allclose(ppl[0].nll_full, ppl[1].nll_full, rtol=1e-5)

    streams = [run_streaming(r, documents, ["snapkv"], [40, 56], buffer=8, bucket=16) for r in (replicas, here)]
    assert [(run.name, run.budget) for run in streams[0].runs] == [(run.name, run.budget) for run in streams[1].runs]
    for mine, theirs in zip(streams[0].runs, streams[1].runs, strict=True):
        np.testing.assert_allclose(np.stack(mine.nll), np.stack(theirs.nll), rtol=1e-5)
        assert mine.peak == theirs.peak


@dataclass(frozen=True)
class DiesOnce:
    """A work whose replica is killed (kill -9) inside the first cell it starts: the cell's rows are never made."""

    work: Work
    marker: Path

    def __call__(self, model: torch.nn.Module, tokenizer: object, cell: object) -> object:
        try:  # created by exactly one replica, even when two start their first cells at once
            marker = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return self.work(model, tokenizer, cell)
        os.write(marker, str(os.getpid()).encode())
        os.close(marker)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable: this process was killed")


@dataclass
class KillsAReplicaOnce:
    """`runner` with its work wrapped in `DiesOnce` (this module is pickled by value, so replicas can run it)."""

    runner: RayRunner
    marker: Path

    def map(self, work: Work, cells: list) -> Iterator:
        return self.runner.map(DiesOnce(work, self.marker), cells)


def test_a_worker_killed_mid_cell_loses_and_repeats_no_row(replicas, samples, local_rows, tmp_path):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    path, marker, before = tmp_path / "results.jsonl", tmp_path / "killed", replicas.worker_pids()
    rows = run_sweep(KillsAReplicaOnce(replicas, marker), samples, POLICIES, RATES, MODES, results=path)
    killed = int(marker.read_text())
    after = replicas.worker_pids()  # Ray restarted that replica (it loaded the model again) and re-ran its cells
    assert killed in before and killed not in after and len(set(before) & set(after)) == 1
    keys = [row_key(row) for row in read_rows(path)]
    assert len(keys) == len(set(keys)) == len(local_rows)
    assert_same_rows(rows, local_rows)


def test_placement_and_its_errors():
    cpu_node, gpu_node = {"CPU": 4.0}, {"CPU": 8.0, "GPU": 2.0}
    assert place(ModelChoice(), [cpu_node, cpu_node], None, None).workers == 2  # one per node, cores shared
    assert place(ModelChoice(), [cpu_node, cpu_node], None, None).cpus == 4
    assert place(ModelChoice(), [cpu_node], 3, None).cpus == 1
    cuda = ModelChoice(device=torch.device("cuda"))
    assert place(cuda, [gpu_node], None, None) == place(cuda, [gpu_node], 2, 4)  # one per GPU
    for model, nodes, workers, cpus, message in [
        (ModelChoice(), [cpu_node], 2, 4, "2 workers x 4 CPUs need 8; the Ray cluster has 4"),
        (ModelChoice(), [cpu_node], 5, None, "5 workers x 1 CPUs need 5"),
        (cuda, [cpu_node], None, None, "the model runs on cuda, but the Ray cluster has no GPU"),
        (cuda, [gpu_node], 3, 1, "3 workers need a GPU each; the Ray cluster has 2"),
    ]:
        with pytest.raises(ValueError, match=message):
            place(model, nodes, workers, cpus)


def test_a_cells_error_reaches_the_driver_as_itself(replicas, samples):
    """A cell that fails on a replica raises its own error here (not Ray's wrapper), and is not retried forever."""
    bad = SurvivalCell(samples[0], KvsievePolicy(make_policy("snapkv")), rate=1.5)
    with pytest.raises(PolicyError, match=r"eviction rate must be in \[0, 1\), got 1.5"):
        run_once(replicas, sample_survival, bad)
    survival, evidence = run_once(replicas, sample_survival, SurvivalCell(samples[0], bad.method, 0.5))
    assert survival.dtype == torch.bool and 0 < survival.float().mean() < 1 and len(evidence) > 0


def test_a_runner_that_is_not_started_says_so(choice, samples):
    with pytest.raises(RuntimeError, match="not started"):
        next(RayRunner(choice).map(sample_survival, samples))


def test_the_harness_does_not_import_ray():
    code = "import sys, kvsieve, kvsieve.harness.cli, kvsieve.harness.eval.sweep; assert 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- a cluster of two nodes, and its drivers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Waits, in a driver of its own, until the cluster at argv[1] has argv[2] nodes alive.
NODES_UP = """
import sys, time, ray
ray.init(address=sys.argv[1], logging_level="WARNING")
while len([node for node in ray.nodes() if node["Alive"]]) < int(sys.argv[2]):
    time.sleep(0.2)
"""


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[str]:
    """A head node and a second node of one CPU each (`ray start --block`: stopping them stops their processes)."""
    address, node = f"127.0.0.1:{_free_port()}", ["--num-cpus", "1", "--block", "--disable-usage-stats"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    head = ["--head", "--port", address.split(":")[1], "--include-dashboard=false"]
    nodes = [subprocess.Popen([RAY, "start", *head, *node], **quiet)]
    try:
        nodes.append(subprocess.Popen([RAY, "start", "--address", address, *node], **quiet))
        subprocess.run([sys.executable, "-c", NODES_UP, address, "2"], check=True, timeout=120, **quiet)
        yield address
    finally:
        for process in reversed(nodes):
            process.terminate()
            process.wait(60)
        current = Path(os.environ.get("RAY_TMPDIR", tempfile.gettempdir()), "ray", "ray_current_cluster")
        if current.exists() and current.read_text().strip().endswith(address.split(":")[1]):
            current.unlink()  # as `ray stop` does, or `--ray auto` would wait for this cluster later


#: A driver that runs the sweep on the cluster at argv[2] and is killed (kill -9) once its first cell is logged.
KILLED_DRIVER = f"""
import os, signal, sys
from kvsieve.harness.data.suites import task_samples
from kvsieve.harness.eval.sweep import run_sweep
from kvsieve.harness.models import ModelChoice
from kvsieve.harness.runners.ray_runner import RayRunner

def killed_after_the_first_cell(done, total):
    if done > 0:
        os.kill(os.getpid(), signal.SIGKILL)

choice = ModelChoice(sys.argv[1])
with RayRunner(choice, sys.argv[2], workers=2, cpus_per_worker=1) as runner:
    samples = task_samples({TASKS!r}, choice.load_tokenizer(), length={LENGTH}, n=2, seed=0)
    sweep = {POLICIES!r}, {RATES!r}, {MODES!r}
    run_sweep(runner, samples, *sweep, results=sys.argv[3], progress=killed_after_the_first_cell)
"""


def test_a_sweep_across_two_nodes_survives_its_driver_killed(two_nodes, model_dir, local_rows, tmp_path):
    """Two replicas of one CPU must sit on two nodes; the driver dies after one cell; `kvsieve sweep` resumes."""
    out = tmp_path / "sweep"
    log = out / RESULTS_FILE
    killed = subprocess.run([sys.executable, "-c", KILLED_DRIVER, str(model_dir), two_nodes, str(log)])
    assert killed.returncode == -signal.SIGKILL
    first = read_rows(log)
    assert len(first) == 1 + 2 * len(RATES)  # one cell: the full cache, then each policy at each rate

    options = [
        "--tasks",
        TASKS,
        "--policies",
        POLICIES,
        "--rates",
        ",".join(map(str, RATES)),
        "--modes",
        ",".join(MODES),
    ]
    options += ["--samples", "2", "--length", str(LENGTH), "--no-maps", "--out", str(out), "--model", str(model_dir)]
    options += ["--ray", two_nodes, "--workers", "2", "--cpus-per-worker", "1"]
    driver = "from kvsieve.harness.cli import app; app()"
    subprocess.run([sys.executable, "-c", driver, "sweep", *options], check=True, stdout=subprocess.DEVNULL)
    rows = read_rows(log)
    assert rows[: len(first)] == first and len({row_key(row) for row in rows}) == len(rows) == len(local_rows)
    assert_same_rows(pd.DataFrame(rows), local_rows)  # the resumed run appends the cells left, in order
    assert json.loads((out / MANIFEST_FILE).read_text())["model"] == str(model_dir)
