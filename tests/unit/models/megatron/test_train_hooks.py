"""The training loop's hooks and metrics writer on their own: no process group, model or tracking server.

The interval throughput leaves out evaluation and checkpoint time (an injected clock, no timing); one value
per (key, step) in metrics.jsonl and MLflow after a crash and resume."""

from __future__ import annotations

import json
import types

import mlflow.tracking
import pytest
from helpers import tiny_config
from mlflow.entities import Metric

from difflm import tracking
from difflm.models.megatron.hooks import Checkpointer, Hook, IntervalLogger, Step, Validator
from difflm.models.megatron.metrics import MetricsWriter
from difflm.models.megatron.train import Trainer


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """Stands in for the MetricsWriter: the records, by step."""

    def __init__(self):
        self.records: dict[int, dict] = {}

    def log(self, step: int, **metrics) -> None:
        self.records.setdefault(step, {}).update({k: v for k, v in metrics.items() if v is not None})


class FakeTrainer(Trainer):
    """The trainer's hook dispatch and what the hooks read, without a process group, model or data."""

    def __init__(self, cfg, hooks: list[Hook], clock: Clock):
        self.cfg, self.hooks, self.clock, self.excluded_s = cfg, hooks, clock, 0.0
        self.n_devices, self.peak = 1, None
        self.unique_tokens = 1280  # test-tiny: 4 x 32 tokens a step, an epoch every 10 steps
        self.opt = types.SimpleNamespace(param_groups=[{"lr": 1e-3}])
        self.metrics, self.lines = Recorder(), []
        self.log = self.lines.append


class Pause(Hook):
    """Stands in for evaluation or a checkpoint save: `seconds` outside training after the given iterations."""

    counts_as_training = False

    def __init__(self, at: set[int], seconds: float):
        self.at, self.seconds = at, seconds

    def post_step(self, trainer, step):
        if step.it in self.at:
            trainer.clock.now += self.seconds


def test_interval_throughput_leaves_out_evaluation_and_checkpoint_time(tmp_path):
    """Review nit: with eval_interval / save_interval not multiples of log_interval, the pauses fall inside a
    logging interval; they must not lower its tokens/s and MFU. One step = 1 s and 100 tokens here."""
    cfg = tiny_config(tmp_path, "train.train_iters=12", "train.log_interval=4", "train.eval_interval=6")
    clock = Clock()
    trainer = FakeTrainer(cfg, [IntervalLogger(), Pause({4, 6, 9}, seconds=30.0)], clock)
    trainer.run_hooks("on_start")
    for it in range(1, 13):
        clock.now += 1.0  # the step itself
        trainer.run_hooks("post_step", Step(it=it, loss=2.0, tokens=100, flops=1e12))
    recs = trainer.metrics.records
    assert sorted(recs) == [4, 8, 12]
    # a pause right after a logged step (4), inside an interval (6) and in the last one (9): none counts
    assert [recs[s]["tokens_per_s"] for s in (4, 8, 12)] == [pytest.approx(100.0)] * 3
    assert [recs[s]["tflops_per_device"] for s in (4, 8, 12)] == [pytest.approx(1.0)] * 3
    assert trainer.excluded_s == pytest.approx(90.0)
    assert [recs[s]["epochs"] for s in (4, 8, 12)] == [pytest.approx(0.4), pytest.approx(0.8), pytest.approx(1.2)]
    assert "100 tok/s" in trainer.lines[1]


def test_evaluation_and_checkpoints_are_not_training_time():
    assert not Validator.counts_as_training and not Checkpointer.counts_as_training
    assert IntervalLogger.counts_as_training  # its own time, and the preemption check's, are per-step costs


# ---- one value per (key, step) after a crash and resume ---------------------------------------------


def _records(steps, **values) -> list[dict]:
    return [{"step": s, "time": 100.0 + s, **values} for s in steps]


def _write(path, records, torn: bool = False) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + ('{"step": 9, "lo' if torn else ""))


def test_a_resumed_attempt_drops_what_it_logs_again(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = [{"step": 0, "time": 1.0, "val_loss": 9.0}] + _records(range(1, 9), loss=3.0)
    _write(path, first, torn=True)  # killed after iteration 8, mid-write; resumes from checkpoint 5
    writer = MetricsWriter(path, True, first_step=6)
    assert [json.loads(line) for line in path.read_text().splitlines()] == first[:6]  # 0..5, nothing torn
    for step in range(6, 9):
        writer.log(step, loss=2.0)
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == list(range(9))
    assert not list(tmp_path.glob("*.part"))

    _write(path, first)
    MetricsWriter(path, False, first_step=0)  # another rank: never touches the file
    MetricsWriter(path, True)  # no first step given: appends as before
    assert len(path.read_text().splitlines()) == 9
    MetricsWriter(path, True, first_step=0)  # from scratch: nothing of the interrupted attempt stays
    assert path.read_text() == ""


class FakeMlflow:
    """An MLflow client holding some metrics already; records what it is sent."""

    def __init__(self, on_server: dict[str, list[int]] | None = None):
        self.history = {k: [Metric(k, 1.0, 0, s) for s in steps] for k, steps in (on_server or {}).items()}
        self.sent: list = []

    def get_metric_history(self, run_id, key):
        return list(self.history.get(key, []))

    def log_batch(self, run_id, metrics, synchronous=True):
        self.sent.extend(metrics)
        for m in metrics:
            self.history.setdefault(m.key, []).append(m)


@pytest.fixture
def fake_mlflow(monkeypatch):
    client = FakeMlflow()
    monkeypatch.setattr(mlflow.tracking, "MlflowClient", lambda *a, **k: client)
    return client


def test_live_metrics_never_resend_what_the_interrupted_attempt_sent(tmp_path, fake_mlflow):
    """The first attempt logged iterations 1..8 and sent 1..7 before it was killed; the second resumes from
    checkpoint 5 and logs 6..10 again: MLflow gets 8, 9 and 10, and holds one value per (key, step)."""
    fake_mlflow.history = FakeMlflow({"loss": list(range(1, 8)), "lr": list(range(1, 8))}).history
    path = tmp_path / "metrics.jsonl"
    _write(path, _records(range(1, 9), loss=3.0, lr=0.1))
    writer = MetricsWriter(path, True, "run", say=lambda _: None, first_step=6)
    for step in range(6, 11):
        writer.log(step, loss=2.0, lr=0.1)
    writer.close()
    assert sorted((m.key, m.step) for m in fake_mlflow.sent) == [(k, s) for k in ("loss", "lr") for s in (8, 9, 10)]
    for key in ("loss", "lr"):
        steps = [m.step for m in fake_mlflow.history[key]]
        assert sorted(steps) == list(range(1, 11)), key


def test_backfill_sends_one_value_per_key_and_step_the_last_one(fake_mlflow):
    """A metrics.jsonl written before the fix holds steps 6 and 7 twice (a crash after 7,
    a resume from checkpoint 5); the server got nothing. The backfill sends each (key, step) once, the copy
    logged last, and stays idempotent."""
    records = _records(range(1, 8), loss=3.0, tokens_per_s=1000.0)
    records += [{**r, "time": r["time"] + 100, "tokens_per_s": 900.0} for r in _records(range(6, 11), loss=3.0)]
    sent = tracking.reconcile_metrics("run", records)
    pairs = [(m.key, m.step) for m in fake_mlflow.sent]
    assert len(pairs) == len(set(pairs)) == sent == 20
    tps = {m.step: m.value for m in fake_mlflow.sent if m.key == "tokens_per_s"}
    assert tps == {**{s: 1000.0 for s in range(1, 6)}, **{s: 900.0 for s in range(6, 11)}}
    assert tracking.reconcile_metrics("run", records) == 0
