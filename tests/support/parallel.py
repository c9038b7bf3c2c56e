"""The suite on two processes (`make test`: pytest-xdist, `-n 2 --dist loadfile`, docs/testing.md): a module runs
whole on one worker (its module-scoped fixtures, a started stack or trained run, are built once), the longest
modules first, and a worker is handed the next module only when it is about to run out of work. About half of the
serial suite's wall time was one core waiting (servers starting, Slurm polling, image builds, flow runs watched
through a CLI): the other worker fills it.

Nothing here is needed without xdist: a serial `pytest` orders the modules the same way and runs them in one
process."""

from __future__ import annotations

from pathlib import Path

import pytest

# Seconds a module took in the serial suite (junit report of a clean-clone `make test` on the idle 2-core machine,
# 2026-12-06, commit 0811e8e; modules over 10 s). Used only to order the work, longest first, so that no long module
# starts last while the other worker idles; a module not listed counts as short. A module that grows past a minute
# belongs here (docs/testing.md lists them with their reasons).
MODULE_SECONDS = {
    "tests/integration/test_faults.py": 247,
    "tests/gpu/test_gpu_check.py": 225,
    "tests/integration/test_slurm.py": 215,
    "tests/integration/test_docker_compose.py": 179,
    "tests/integration/test_training.py": 172,
    "tests/integration/test_adaptation.py": 151,
    "tests/integration/test_overlap.py": 114,
    "tests/integration/test_production_stack.py": 109,
    "tests/integration/test_deployment.py": 97,
    "tests/integration/test_stage_flows.py": 80,
    "tests/integration/test_parallel.py": 50,  # 142 before its cases shared two torchruns
    "tests/unit/models/hf/test_hf_import.py": 59,
    "tests/unit/models/evaluation/test_evaluation.py": 54,
    "tests/integration/test_confident_decoding.py": 66,  # 2026-12-07, alone under a load of 7-11: two trainings
    "tests/integration/test_study.py": 37,
    "tests/integration/test_flow.py": 34,
    "tests/unit/test_security.py": 33,
    "tests/integration/test_ui_browser.py": 22,
    "tests/unit/models/megatron/test_kernels.py": 19,
    "tests/integration/test_data_budget.py": 15,
    "tests/unit/test_layout.py": 14,
    "tests/unit/data_prep/test_data_faults.py": 13,
    "tests/unit/models/launch/test_cluster_submit.py": 12,
}


def is_worker(config: pytest.Config) -> bool:
    """Whether this process is an xdist worker (it has `workerinput`), not the controller or a serial run."""
    return hasattr(config, "workerinput")


def run_root(config: pytest.Config, basetemp: Path) -> Path:
    """The temp folder of the whole run: a worker's basetemp lies in the controller's (`<controller>/popen-gw0`)."""
    return basetemp.parent if is_worker(config) else basetemp


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def longest_modules_first(items: list[pytest.Item]) -> None:
    """Reorder `items` in place: modules by MODULE_SECONDS, longest first; a module's own tests and the unlisted
    modules keep their order (the same on every worker: xdist checks that all collected the same list)."""
    rank = {m: -s for m, s in MODULE_SECONDS.items()}
    position = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(_module(item), 0), position[id(item)]))


def scheduler(config: pytest.Config, log):
    """For `--dist loadfile`: xdist's per-file scheduling in the collection order above (its own reorders by the
    number of tests) and without its look-ahead of two modules per worker (a worker would hold a long module
    while the other runs dry); None for any other mode (xdist's own)."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling  # lazy: xdist is imported by its plugin, only when installed

    class LongestFirst(LoadFileScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            config.option.loadscopereorder = False  # the collection's order: longest_modules_first

        def _reschedule(self, node) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            # a worker runs a test once it knows the next one (for teardown): with one test left it would wait, so
            # it gets the next module then, and not before
            if self._pending_of(self.assigned_work[node]) > 1:
                return
            self._assign_work_unit(node)

    return LongestFirst(config, log)
