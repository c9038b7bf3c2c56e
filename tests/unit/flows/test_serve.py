"""`difflm serve`: each deployment one flow run at a time, a late run queued or cancelled per pipeline.late_runs."""

from prefect.client.schemas.objects import ConcurrencyLimitStrategy

from difflm.config import load_config
from flows.commands import LATE_RUNS, one_at_a_time


def test_a_served_deployment_runs_one_flow_run_at_a_time_and_queues_a_late_one_by_default():
    limit = one_at_a_time(load_config("test-tiny", []))
    assert limit.limit == 1 and limit.collision_strategy == ConcurrencyLimitStrategy.ENQUEUE
    assert "waits for it" in LATE_RUNS["queue"]


def test_pipeline_late_runs_cancel_cancels_a_late_run():
    limit = one_at_a_time(load_config("test-tiny", ["pipeline.late_runs=cancel"]))
    assert limit.limit == 1 and limit.collision_strategy == ConcurrencyLimitStrategy.CANCEL_NEW
    assert "cancelled" in LATE_RUNS["cancel"]
