"""`difflm serve`: each deployment one flow run at a time, a late run queued or cancelled per pipeline.late_runs."""

import signal
import time

from prefect.client.schemas.objects import ConcurrencyLimitStrategy

from difflm.config import load_config
from difflm.flows.commands import LATE_RUNS, one_at_a_time


def test_a_served_deployment_runs_one_flow_run_at_a_time_and_queues_a_late_one_by_default():
    limit = one_at_a_time(load_config("test-tiny", []))
    assert limit.limit == 1 and limit.collision_strategy == ConcurrencyLimitStrategy.ENQUEUE
    assert "waits for it" in LATE_RUNS["queue"]


def test_pipeline_late_runs_cancel_cancels_a_late_run():
    limit = one_at_a_time(load_config("test-tiny", ["pipeline.late_runs=cancel"]))
    assert limit.limit == 1 and limit.collision_strategy == ConcurrencyLimitStrategy.CANCEL_NEW
    assert "cancelled" in LATE_RUNS["cancel"]


def test_ctrl_c_that_prefects_runner_takes_and_survives_still_exits_130_with_one_line(monkeypatch, tmp_path, capsys):
    """Reproduced in a clean-clone run on a loaded machine: Prefect's runner caught the Ctrl-C, shut down within the
    grace period and returned, and `difflm serve` exited 0 with Prefect's log line last. A Ctrl-C is an interrupt
    whoever handles it: exit 130 and difflm's line, and no "did not answer" line from the grace timer after it."""
    from difflm.flows import commands
    from difflm.flows.pretrain import pretrain_difflm

    def runner_that_takes_the_interrupt(**_):
        try:
            signal.raise_signal(signal.SIGINT)  # the Ctrl-C, while the runner polls
        except KeyboardInterrupt:
            pass  # what Prefect's runner does: "Received KeyboardInterrupt, shutting down..."

    monkeypatch.setattr(pretrain_difflm, "serve", runner_that_takes_the_interrupt)
    gave_up = []
    monkeypatch.setattr(commands.os, "_exit", gave_up.append)
    monkeypatch.setattr(commands, "SERVE_GRACE_SECONDS", 0.2)
    cfg = load_config("test-tiny", [f"workdir={tmp_path}"])
    before = signal.getsignal(signal.SIGINT)
    code = commands.serve(cfg, "pretrain-difflm", "stop", None, None, None, 4, None, "test-tiny", [])
    time.sleep(0.4)  # past the grace period: its timer was cancelled
    assert code == 130 and not gave_up
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("difflm: serve stopped on Ctrl-C"), err
    assert signal.getsignal(signal.SIGINT) is before  # the handler is put back


def test_ctrl_c_that_prefects_runner_lets_through_exits_130_with_serves_line(monkeypatch, tmp_path, capsys):
    """Reproduced in a clean-clone run (2026-12-06): the KeyboardInterrupt came out of the runner, and the CLI's
    catch-all said "interrupted; rerun the same command to resume", a line for a pipeline, not for `serve`."""
    from difflm.flows import commands
    from difflm.flows.pretrain import pretrain_difflm

    def runner_that_lets_it_through(**_):
        signal.raise_signal(signal.SIGINT)  # the Ctrl-C, while the runner polls; it propagates

    monkeypatch.setattr(pretrain_difflm, "serve", runner_that_lets_it_through)
    gave_up = []
    monkeypatch.setattr(commands.os, "_exit", gave_up.append)
    monkeypatch.setattr(commands, "SERVE_GRACE_SECONDS", 0.2)
    cfg = load_config("test-tiny", [f"workdir={tmp_path}"])
    code = commands.serve(cfg, "pretrain-difflm", "stop", None, None, None, 4, None, "test-tiny", [])
    time.sleep(0.4)
    assert code == 130 and not gave_up
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("difflm: serve stopped on Ctrl-C")
