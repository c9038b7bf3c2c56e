"""Shared fixtures. Everything runs offline on the CPU; servers the tests need are started here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from difflm import set_offline_env

set_offline_env()  # before anything imports Prefect, MLflow or transformers

from helpers import tiny_config  # noqa: E402

# Tiers (docs/testing.md): a test that uses one of these fixtures, or is marked slow or integration, is not a unit
# test; every other one is marked `unit` here, so `pytest -m unit` (make test-fast) runs the pure tests alone.
# (own_run: tests/test_rundir.py prepares its own corpus and exports a model)
NOT_UNIT_FIXTURES = {"tiny_manifest", "prefect_harness", "megatron_single_process", "own_run", "slurm_cluster"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") or item.get_closest_marker("integration"):
            continue
        if NOT_UNIT_FIXTURES.isdisjoint(item.fixturenames):
            item.add_marker(pytest.mark.unit)


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("difflm")


@pytest.fixture(scope="session")
def tiny_manifest(session_dir) -> dict:
    """Data prep of the test-tiny preset, shared by the tests that need real tokenized data."""
    from data_prep.pipeline import prepare_data

    return prepare_data(tiny_config(session_dir / "shared"))


@pytest.fixture(scope="session")
def megatron_single_process():
    """A one-process gloo group with megatron's parallel state (TP=PP=1) and the CPU compat layer."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from models.megatron import compat
    from models.megatron.distributed import single_process_group

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
