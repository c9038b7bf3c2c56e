"""The end-to-end runs of `pretrain-difflm` as rows of one table: a preset, its overrides, how it is started
and the properties of the finished workdir to assert. A test module starts a row's run its own way (in-process,
`difflm serve`, a worker of the production stack or of the Slurm cluster) and checks what only it can see
(MLflow on the stack, the worker's log); what every run leaves behind is checked here, by name."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from helpers import SHORT_RUN

STAGES = ("data-prep", "train", "convert", "evaluate")
SIX_STEPS = ("train.train_iters=6", "train.schedule.warmup_iters=1", "checkpoint.save_interval=6")


def _one_export(workdir: Path) -> None:
    exports = list(workdir.glob("runs/*/hf/model.safetensors"))
    assert len(exports) == 1, exports


def _evaluated(workdir: Path) -> None:
    assert len(list(workdir.glob("runs/*/eval/results.json"))) == 1


def _trained_in_a_slurm_job(workdir: Path) -> None:
    (record,) = workdir.glob("runs/*/slurm-job.json")
    job_id = json.loads(record.read_text())["job_id"]
    assert "[train] mode=difflm-noshift start_iter=0" in (record.parent / f"slurm-{job_id}.out").read_text()


# what a finished run leaves in its workdir, by name
PROPERTIES: dict[str, Callable[[Path], None]] = {
    "one export": _one_export,
    "evaluated": _evaluated,
    "trained in a Slurm job": _trained_in_a_slurm_job,
}


@dataclass(frozen=True)
class Scenario:
    """One end-to-end run: `preset` with `overrides` (after `workdir=...`), through `deployment` where it is
    started as a Prefect deployment; `expect` names PROPERTIES of its workdir."""

    preset: str
    overrides: tuple[str, ...]
    expect: tuple[str, ...] = ("one export", "evaluated")
    deployment: str | None = None
    stages: tuple[str, ...] = STAGES

    def dotlist(self, workdir: Path) -> list[str]:
        return [f"workdir={workdir}", *self.overrides]

    def params(self, workdir: Path) -> dict:
        """The flow parameters of `prefect deployment run --params`."""
        return {"preset": self.preset, "overrides": self.dotlist(workdir)}

    def check(self, workdir: Path) -> None:
        for name in self.expect:
            PROPERTIES[name](workdir)


SCENARIOS: dict[str, Scenario] = {
    # tests/integration/test_flow.py: the flagship flow in-process on a Prefect test server, long enough for training to help
    "flagship": Scenario("test-tiny", ("train.train_iters=30", "train.optimizer.lr=5e-3")),
    # tests/integration/test_deployment.py: `difflm serve pretrain-difflm` and `prefect deployment run ... --watch`
    "serve": Scenario("test-tiny", (*SIX_STEPS, "tracking.enabled=false"), deployment="pretrain-difflm/ci"),
    # tests/integration/test_production_stack.py: prefect.yaml's deployment on the stack's process worker, tracked in MLflow
    "stack": Scenario("test-tiny", SIX_STEPS, deployment="pretrain-difflm/local"),
    # tests/integration/test_docker_compose.py: prefect.yaml's deployment on docker-compose.yml's worker container, in
    # MLflow (its workdir lies in the container's volume: checked through MLflow, not here)
    "docker": Scenario("test-tiny", SIX_STEPS, expect=(), deployment="pretrain-difflm/tiny-cpu"),
    # tests/integration/test_slurm.py: prefect.yaml's Slurm deployment, training as a job of the local cluster
    "slurm": Scenario(
        "test-tiny",
        (
            "train.launch.launcher=slurm",
            "train.launch.slurm.gpus_per_node=0",
            *SHORT_RUN,
            "train.launch.wait.poll_seconds=0.5",
            "tracking.enabled=false",
        ),
        expect=("one export", "evaluated", "trained in a Slurm job"),
        deployment="pretrain-difflm/slurm",
    ),
}
