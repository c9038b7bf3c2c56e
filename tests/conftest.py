"""Shared fixtures. Everything runs offline on the CPU; servers the tests need are started here."""

from __future__ import annotations

import importlib
import multiprocessing.process
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from difflm import set_offline_env
from difflm.config import PipelineConfig
from difflm.manifest import DataManifest
from difflm.rundir import TrainResult

set_offline_env()  # before anything imports Prefect, MLflow or transformers

import docker_prebuild  # noqa: E402
import llama_cpp_prebuild  # noqa: E402
import parallel  # noqa: E402
import servers  # noqa: E402
import timing  # noqa: E402
from helpers import tiny_config, trained_overrides  # noqa: E402

# Tiers (docs/testing.md): a test that uses one of these fixtures, or is marked slow or integration, is not a unit
# test; every other one is marked `unit` here, so `pytest -m unit` (make test-fast) runs the pure tests alone.
# (own_run: tests/unit/difflm/test_rundir.py prepares its own corpus and exports a model; trained: a shared trained run)
NOT_UNIT_FIXTURES = {
    "tiny_manifest",
    "prefect_harness",
    "megatron_single_process",
    "own_run",
    "slurm_cluster",
    "trained",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") or item.get_closest_marker("integration"):
            continue
        if NOT_UNIT_FIXTURES.isdisjoint(item.fixturenames):
            item.add_marker(pytest.mark.unit)
    parallel.longest_modules_first(items)


def pytest_collection_finish(session):
    if not parallel.is_worker(session.config):  # under xdist the controller starts it (below): once, not per worker
        docker_prebuild.start(session.items)  # the Docker test's images, built while the tests before it run
        llama_cpp_prebuild.start(session.items)  # llama.cpp's diffusion CLI, likewise


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    docker_prebuild.start_for(ids)  # the controller: the workers' collection names the Docker test
    llama_cpp_prebuild.start_for(ids)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return parallel.scheduler(config, log)


def pytest_sessionfinish(session):
    docker_prebuild.stop()
    llama_cpp_prebuild.stop()
    if parallel.is_worker(session.config):  # the unit tests' CPU, for the controller's summary
        session.config.workeroutput["unit_cpu"] = _unit_cpu


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _unit_cpu.update(getattr(node, "workeroutput", {}).get("unit_cpu", {}))


# ----- the fast tier's promise: a unit test starts no process and costs little CPU ------------------------------

# CPU seconds (time.process_time: all threads of this process, about the same on a loaded machine) a unit test may
# use, its set-up included and its first imports of modules not (Transformers' modeling code alone is ~5 s, paid
# once a session by whichever test imports it first); $DIFFLM_UNIT_CPU_BUDGET overrides it (0: no limit, e.g.
# under a profiler or coverage). 10 s: twice the costliest unit test with torch's two intra-op threads (4.6 s on
# 2026-12-05; OpenMP's waiting threads count as CPU too), so a loaded CI machine does not fail a test that is cheap
UNIT_CPU_BUDGET_S = float(os.environ.get("DIFFLM_UNIT_CPU_BUDGET", "10"))
FIX = "mark it @pytest.mark.integration (or slow), or make it cheaper (docs/testing.md)"


class ProcessInUnitTest(RuntimeError):
    """Raised where a unit test would have started a process."""


def _importing() -> bool:
    """Whether a module is being imported: a library that starts a process when imported (Prefect's vendored
    croniter runs `file` on the interpreter) does it once a session, in whichever test imports it first."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


class UnitGuard:
    """What one unit test did: the processes it tried to start and the CPU it used, less first imports."""

    def __init__(self) -> None:
        self.spawned: list[str] = []
        self.cpu_at_start = time.process_time()
        self.importing_cpu = 0.0
        self._depth = 0

    def cpu(self) -> float:
        return time.process_time() - self.cpu_at_start - self.importing_cpu

    def _refuse(self, what: str, module: str, qualname: str, real: Callable) -> Callable:
        def refused(*args, **kwargs):
            if _importing():
                return real(*args, **kwargs)
            argv = f" {str(args[1])[:100]}" if what == "subprocess" and len(args) > 1 else ""
            self.spawned.append(what + argv)
            raise ProcessInUnitTest(f"a unit test started a process ({what + argv}): {FIX}")

        # pickled by reference as what it replaces (a test may pickle a payload that names os.system)
        refused.__module__, refused.__qualname__, refused.__name__ = module, qualname, qualname.split(".")[-1]
        return refused

    def _timed(self, find_and_load: Callable) -> Callable:
        def timed(name, import_):
            if self._depth:  # (an import inside an import: counted by the outer one)
                return find_and_load(name, import_)
            self._depth += 1
            t = time.process_time()
            try:
                return find_and_load(name, import_)
            finally:
                self.importing_cpu += time.process_time() - t
                self._depth -= 1

        return timed

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Every way the standard library starts a process (subprocess and all that use it, fork, posix_spawn,
        os.system, multiprocessing) is recorded and refused; first imports of modules are timed (the import
        statement and importlib both load a module through importlib._bootstrap._find_and_load)."""
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(importlib._bootstrap, "_find_and_load", self._timed(importlib._bootstrap._find_and_load))
            child = self._refuse("subprocess", "subprocess", "Popen._execute_child", subprocess.Popen._execute_child)
            mp.setattr(subprocess.Popen, "_execute_child", child)
            process = multiprocessing.process.BaseProcess
            start = self._refuse("multiprocessing", "multiprocessing.process", "BaseProcess.start", process.start)
            mp.setattr(process, "start", start)
            for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
                real = getattr(os, name)  # posix.system, re-exported by os
                refused = self._refuse(f"os.{name}", real.__module__, name, real)
                mp.setattr(os, name, refused)
                mp.setattr(sys.modules[real.__module__], name, refused)
            yield


_guard = pytest.StashKey[UnitGuard]()
_unit_cpu: dict[str, float] = {}  # CPU seconds of each unit test that ran, for the summary


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker("unit") is None:
        return (yield)
    guard = item.stash[_guard] = UnitGuard()
    with guard.watching():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    guard = item.stash.get(_guard, None)
    if guard is None:  # not a unit test
        return (yield)
    with guard.watching():
        try:
            result = yield
        finally:
            _unit_cpu[item.nodeid] = guard.cpu()
    if guard.spawned:  # (also when the test caught the error)
        pytest.fail(f"a unit test started a process ({', '.join(guard.spawned)}): {FIX}", pytrace=False)
    if UNIT_CPU_BUDGET_S and guard.cpu() > UNIT_CPU_BUDGET_S:
        pytest.fail(
            f"a unit test used {guard.cpu():.1f} s of CPU (first imports of modules not counted), over the budget "
            f"of {UNIT_CPU_BUDGET_S:g} s: {FIX}",
            pytrace=False,
        )
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    timing.check_long(item, report)  # over a minute: a `slow` mark with its reason (tests/support/timing.py)
    return report


def pytest_runtest_logreport(report):
    timing.record(report)  # the tiers' times (under xdist in the controller, from every worker's reports)


def pytest_terminal_summary(terminalreporter):
    tiers = timing.summary()
    if tiers and not parallel.is_worker(terminalreporter.config):
        terminalreporter.write_line(tiers)
    if _unit_cpu:
        most = sorted(_unit_cpu.items(), key=lambda kv: -kv[1])[:3]
        terminalreporter.write_line(
            f"unit tests: {len(_unit_cpu)}, {sum(_unit_cpu.values()):.1f} s of CPU in all (first imports not counted; "
            f"budget {UNIT_CPU_BUDGET_S:g} s each); the most: " + ", ".join(f"{cpu:.1f} s {n}" for n, cpu in most)
        )


@pytest.fixture(scope="module", autouse=True)
def _mlflow_uri_left_as_found() -> Iterator[None]:
    """`mlflow.set_tracking_uri` (the pipeline's, a test's) also sets $MLFLOW_TRACKING_URI, which `tracking.uri`
    falls back to: left behind, it sent a later module's CLI processes to another test's store. Each module leaves
    it as it found it."""
    keys = ("MLFLOW_TRACKING_URI", "DIFFLM_TRACKING_URI_CHOSEN")  # the second: difflm.tracking.use_store's mark
    before = {k: os.environ.get(k) for k in keys}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("difflm")


@pytest.fixture(scope="session")
def shared_dir(request, tmp_path_factory) -> Path:
    """One folder for the whole run, every xdist worker included (the workers' temp folders lie in the controller's):
    what the pipeline writes there under its own locks (the trained runs of `trained` and their exports) is made
    once and reused by all."""
    return parallel.run_root(request.config, tmp_path_factory.getbasetemp()) / "shared"


# Fixtures import what they set up: this module loads for every run, one test file included, so megatron, data
# prep and deploy (seconds each) stay out of it, and Prefect reads PREFECT_HOME when imported, set just before.
@pytest.fixture(scope="session")
def tiny_manifest(session_dir) -> DataManifest:
    """Data prep of the test-tiny preset, shared by the tests that need real tokenized data (once per xdist worker:
    the tests that use it also write runs and MLflow stores into its workdir)."""
    from difflm.data_prep.pipeline import prepare_data

    return prepare_data(tiny_config(session_dir / "shared"))


@dataclass(frozen=True)
class TrainedRun:
    """A shared trained run: its config and what its launch returned (`info.run`, `info.checkpoint`)."""

    cfg: PipelineConfig
    info: TrainResult


@pytest.fixture(scope="session")
def trained(shared_dir, tiny_manifest) -> Callable[[str], TrainedRun]:
    """`trained(mode)`: the shared trained run of `mode` ("masked", "ar", "block", "shift", ...; helpers.TRAINED_MODES), trained
    through the real launcher with the canonical short-run settings (helpers.TRAINED) the first time a test asks,
    in a workdir of the whole run: a later ask, from this worker or the other, is the pipeline's own reuse (a
    finished run), and one asked while it trains waits on the run's lock. Its export (`convert_checkpoint`) is
    shared the same way. Tests that watch training itself (faults, preemption, resume) train their own."""
    from difflm.models.launch.torchrun import launch_training  # lazy: megatron (see above)

    runs: dict[str, TrainedRun] = {}  # this worker's: the launcher's reuse check once per mode, not per ask

    def get(mode: str) -> TrainedRun:
        if mode not in runs:
            cfg = tiny_config(shared_dir / "trained", *trained_overrides(mode))
            runs[mode] = TrainedRun(cfg, launch_training(cfg, tiny_manifest, echo=lambda _: None))
        return runs[mode]

    return get


@pytest.fixture(scope="session")
def megatron_single_process():
    """A one-process gloo group with megatron's parallel state (TP=PP=1) and the CPU compat layer."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from difflm.models.megatron import compat
    from difflm.models.megatron.distributed import single_process_group

    with single_process_group():
        compat.activate()
        if parallel_state.model_parallel_is_initialized():  # left behind by code that owned another group
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        yield dist.get_world_size()
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="session")
def prefect_harness(session_dir):
    """A real (temporary) Prefect server and database for flow tests."""
    os.environ["PREFECT_HOME"] = str(session_dir / "prefect-home")
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=60):
        yield


@pytest.fixture
def prefect_server(tmp_path) -> Iterator[Callable[..., servers.Server]]:
    """Starts a real `prefect server start` (state in tmp_path, a free loopback port) and waits until it answers;
    its `env` is what clients need (PREFECT_API_URL, PREFECT_HOME); keyword arguments set more PREFECT_* variables
    for it and its clients. Stopped at the end of the test, whatever the test did with it."""
    started: list[servers.Server] = []

    def start(**settings: str) -> servers.Server:
        server = servers.prefect_server(tmp_path / f"prefect-{len(started)}", **settings)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def mlflow_server(tmp_path) -> Iterator[Callable[..., servers.Server]]:
    """Starts a real `mlflow server` (sqlite store and artifacts in tmp_path, a free loopback port) and waits until
    it answers; `admin_password=...` starts the basic-auth app as the stack does. It can be killed and started
    again on the same store and port; stopped at the end of the test in any case."""
    started: list[servers.Server] = []

    def start(admin_password: str | None = None) -> servers.Server:
        server = servers.mlflow_server(tmp_path / f"mlflow-{len(started)}", admin_password)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.kill()


def skip_or_fail(why: str) -> None:
    """Skip a test whose system dependency is missing; under CI (`$CI` set) that is a failure instead."""
    if os.environ.get("CI"):
        pytest.fail(f"CI must run this test: {why}")
    pytest.skip(why)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real Slurm cluster on this host (deploy/slurm_local.py: munge, slurmctld, a slurmd for each of two nodes,
    state in a temp folder, free ports), with SLURM_CONF pointing the clients (and the jobs, which inherit it) at
    it; stopped at the end of the session. `make test` installs the packages when run as root; without them, or
    not as root, the tests are skipped (under $CI: failed)."""
    from deploy import slurm_local

    why = slurm_local.unavailable()
    if why:
        skip_or_fail(why)
    try:
        cluster = slurm_local.up(tmp_path_factory.mktemp("slurm"), echo=lambda _: None)
    except slurm_local.SlurmUnavailable as err:
        skip_or_fail(f"the local Slurm cluster did not start: {err}")
    before = os.environ.get("SLURM_CONF")
    os.environ.update(cluster.env)
    try:
        yield cluster
    finally:
        slurm_local.down(cluster.root, echo=lambda _: None)
        os.environ.pop("SLURM_CONF")
        if before is not None:
            os.environ["SLURM_CONF"] = before


@pytest.fixture
def one_thread():
    """Thousands of tiny ops: one thread is faster, and immune to a busy machine (`usefixtures` it per module)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_manifest) -> dict[str, Path]:
    """A random-weight export per mode (difflm-noshift, ar), written exactly as the pipeline writes them (the
    evaluation tests' input)."""
    from difflm.models.hf.convert import hf_config, save_export
    from difflm.models.hf.export import Export
    from difflm.models.hf.modeling_difflm import DiffLMForMaskedLM

    root = tmp_path_factory.mktemp("exports")
    out = {}
    for mode in ("difflm-noshift", "ar"):
        cfg = tiny_config(root, f"diffusion.model_running_mode={mode}")
        torch.manual_seed(0)
        model = DiffLMForMaskedLM(hf_config(cfg, tiny_manifest.tokenizer.to_dict())).eval()
        written = Export(root / mode, None, mode=mode, data_hash=tiny_manifest.hash)  # from no checkpoint
        out[mode] = save_export(model, Path(tiny_manifest.tokenizer.path), written).folder
    return out
