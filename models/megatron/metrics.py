"""Training metrics that never stop training: metrics.jsonl written at once, MLflow fed from a background
thread.

`metrics.jsonl` in the run directory is the record of a run: every metric is appended there synchronously
(a local file). MLflow gets the same values through a bounded queue that a daemon thread sends in batches
(`log_batch`). When the tracking server is slow or down, the thread keeps the unsent metrics, retries with
backoff and says so once in the log; training never waits for it. When the trainer ends, the thread gets a
few seconds to flush; whatever it could not send is still in metrics.jsonl, and the pipeline backfills it
(`difflm.tracking.reconcile_metrics`) once the server answers again.

One value per (key, step), also after a crash: an attempt that resumes from a checkpoint logs the steps after
it again, so it first drops what an interrupted attempt logged from there on (`drop_from`), and its MLflow
thread skips the (key, step) pairs the server already holds from that attempt (MLflow cannot replace a point).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from pathlib import Path


def drop_from(path: Path, first_step: int) -> list[dict]:
    """Remove the records of `first_step` and later from a metrics.jsonl (rewritten atomically: a crash leaves
    the old file or the new one); returns the removed records. A torn last line (a kill during a write) goes too."""
    if not path.exists():
        return []
    kept: list[tuple[str, dict]] = []
    dropped: list[tuple[str, dict]] = []
    torn = False
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            torn = True
            continue
        (kept if rec.get("step", 0) < first_step else dropped).append((line, rec))
    if dropped or torn:
        tmp = path.with_name(path.name + ".part")
        tmp.write_text("".join(line + "\n" for line, _ in kept))
        os.replace(tmp, path)
    return [rec for _, rec in dropped]


def key_steps(records: list[dict]) -> dict[str, set[int]]:
    """{metric key: the steps it was logged at} of metrics.jsonl records."""
    out: dict[str, set[int]] = {}
    for rec in records:
        for k, v in rec.items():
            if k not in ("step", "time") and v is not None:
                out.setdefault(k, set()).add(int(rec["step"]))
    return out


class BackgroundMlflow:
    """A daemon thread sending (key, value, step, timestamp) metrics of one MLflow run in batches.

    `maybe_sent`: {key: steps} an interrupted earlier attempt logged and may have sent. Before its first send
    the thread asks the server which of them it holds and never sends those again: one value per (key, step)."""

    BATCH = 500  # MLflow's log_batch takes at most 1000 metrics
    BACKOFF_S = (1, 2, 5, 10, 30)

    def __init__(
        self, run_id: str, max_pending: int = 200_000, say=print, maybe_sent: dict[str, set[int]] | None = None
    ):
        from mlflow.tracking import MlflowClient  # mlflow (seconds to import) only when metrics go to a server

        self.run_id, self.say, self.max_pending = run_id, say, max_pending
        self.maybe_sent = maybe_sent or {}
        self.on_server: set[tuple[str, int]] | None = None  # of maybe_sent, once the server has answered
        self.client = MlflowClient()
        self.pending: deque = deque()
        self.lock = threading.Condition()
        self.closing = False
        self.degraded = False
        self.dropped = 0  # metrics beyond max_pending while the server was down (still in metrics.jsonl)
        self.sent = 0
        self.thread = threading.Thread(target=self._run, name="mlflow-metrics", daemon=True)
        self.thread.start()

    def put(self, step: int, metrics: dict[str, float], timestamp_ms: int) -> None:
        from mlflow.entities import Metric

        with self.lock:
            for k, v in metrics.items():
                if len(self.pending) >= self.max_pending:
                    self.pending.popleft()
                    self.dropped += 1
                self.pending.append(Metric(k, float(v), timestamp_ms, step))
            self.lock.notify()

    def _run(self) -> None:
        failures = 0
        while True:
            with self.lock:
                while not self.pending and not self.closing:
                    self.lock.wait()
                if not self.pending and self.closing:
                    return
                batch = [self.pending[i] for i in range(min(self.BATCH, len(self.pending)))]
            try:
                if self.on_server is None:
                    self.on_server = self._on_server()
                todo = [m for m in batch if (m.key, m.step) not in self.on_server]
                if todo:
                    self.client.log_batch(self.run_id, metrics=todo, synchronous=True)
            except Exception as err:  # any transport or server error: keep the batch, try again later
                if not self.degraded:
                    self.degraded = True
                    self.say(
                        f"[train] tracking degraded: MLflow did not take metrics ({type(err).__name__}: "
                        f"{str(err)[:160]}); training goes on, every metric stays in metrics.jsonl and is "
                        f"sent when the server answers again"
                    )
                time.sleep(self.BACKOFF_S[min(failures, len(self.BACKOFF_S) - 1)])
                failures += 1
                continue
            with self.lock:
                for _ in batch:
                    self.pending.popleft()
            self.sent += len(todo)
            if self.degraded:
                self.degraded = False
                self.say(f"[train] tracking restored: MLflow reachable again after {failures} failed attempt(s)")
            failures = 0

    def _on_server(self) -> set[tuple[str, int]]:
        """The (key, step) pairs of `maybe_sent` that the run already holds."""
        return {
            (key, m.step)
            for key, steps in self.maybe_sent.items()
            for m in self.client.get_metric_history(self.run_id, key)
            if m.step in steps
        }

    def close(self, timeout_s: float = 10.0) -> int:
        """Flush for at most timeout_s; returns the number of metrics left unsent (backfilled later)."""
        with self.lock:
            self.closing = True
            self.lock.notify()
        self.thread.join(timeout_s)
        with self.lock:
            return len(self.pending) + self.dropped


class MetricsWriter:
    """metrics.jsonl on the reporting rank, and live MLflow metrics when a run id is handed over.

    `first_step`: the first step this attempt logs (0 from scratch, the resumed checkpoint's iteration + 1).
    What an interrupted attempt logged from there on is dropped, as this one logs those steps again; None
    appends to the file as it is."""

    def __init__(self, path: Path, active: bool, run_id: str | None = None, say=print, first_step: int | None = None):
        self.active, self.path, self.say = active, path, say
        stale = drop_from(path, first_step) if active and first_step is not None else []
        self.mlflow = BackgroundMlflow(run_id, say=say, maybe_sent=key_steps(stale)) if active and run_id else None

    def log(self, step: int, **metrics: float | None) -> None:
        if not self.active:
            return
        values = {k: v for k, v in metrics.items() if v is not None}
        now = time.time()
        with self.path.open("a") as fh:
            fh.write(json.dumps({"step": step, "time": now, **values}) + "\n")
        if self.mlflow and values:
            self.mlflow.put(step, values, int(now * 1000))

    def close(self) -> None:
        if self.mlflow:
            left = self.mlflow.close()
            if left:
                self.say(
                    f"[train] tracking: {left} metrics not yet in MLflow; they are in {self.path.name} and "
                    f"the pipeline backfills them"
                )
