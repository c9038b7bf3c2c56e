"""Training metrics that never stop training: metrics.jsonl written at once, MLflow fed from a background
thread.

`metrics.jsonl` in the run directory is the record of a run: every metric is appended there synchronously
(a local file). MLflow gets the same values through a bounded queue that a daemon thread sends in batches
(`log_batch`). When the tracking server is slow or down, the thread keeps the unsent metrics, retries with
backoff and says so once in the log; training never waits for it. When the trainer ends, the thread gets a
few seconds to flush; whatever it could not send is still in metrics.jsonl, and the pipeline backfills it
(`difflm.tracking.reconcile_metrics`) once the server answers again.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from pathlib import Path


class BackgroundMlflow:
    """A daemon thread sending (key, value, step, timestamp) metrics of one MLflow run in batches."""

    BATCH = 500  # MLflow's log_batch takes at most 1000 metrics
    BACKOFF_S = (1, 2, 5, 10, 30)

    def __init__(self, run_id: str, max_pending: int = 200_000, say=print):
        from mlflow.tracking import MlflowClient

        self.run_id, self.say, self.max_pending = run_id, say, max_pending
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
                self.client.log_batch(self.run_id, metrics=batch, synchronous=True)
            except Exception as err:  # any transport or server error: keep the batch, try again later
                if not self.degraded:
                    self.degraded = True
                    self.say(f"[train] tracking degraded: MLflow did not take metrics ({type(err).__name__}: "
                             f"{str(err)[:160]}); training goes on, every metric stays in metrics.jsonl and is "
                             f"sent when the server answers again")
                time.sleep(self.BACKOFF_S[min(failures, len(self.BACKOFF_S) - 1)])
                failures += 1
                continue
            with self.lock:
                for _ in batch:
                    self.pending.popleft()
            self.sent += len(batch)
            if self.degraded:
                self.degraded = False
                self.say(f"[train] tracking restored: MLflow reachable again after {failures} failed attempt(s)")
            failures = 0

    def close(self, timeout_s: float = 10.0) -> int:
        """Flush for at most timeout_s; returns the number of metrics left unsent (backfilled later)."""
        with self.lock:
            self.closing = True
            self.lock.notify()
        self.thread.join(timeout_s)
        with self.lock:
            return len(self.pending) + self.dropped


class MetricsWriter:
    """metrics.jsonl on the reporting rank, and live MLflow metrics when a run id is handed over."""

    def __init__(self, path: Path, active: bool, run_id: str | None = None, say=print):
        self.active, self.path, self.say = active, path, say
        self.mlflow = BackgroundMlflow(run_id, say=say) if active and run_id else None

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
                self.say(f"[train] tracking: {left} metrics not yet in MLflow; they are in {self.path.name} and "
                         f"the pipeline backfills them")
