"""The `pipeline` section: what a run does when another process is writing the same output, or when a
deployment's next run comes while its last one still runs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from difflm.config.base import OPERATIONAL, _Section


class ConcurrencyConfig(_Section):
    on_busy: Literal["wait", "fail"] = Field(
        "wait",
        description="When another process holds a stage's output (the same data, run, export or evaluation): "
        "wait for it and reuse what it wrote, or fail at once with one line saying who holds it.",
        json_schema_extra=OPERATIONAL,
    )
    late_runs: Literal["queue", "cancel"] = Field(
        "queue",
        description="`difflm serve`: each deployment runs one flow run at a time; a run that comes while the "
        "last one still runs waits for it (queue) or is cancelled (cancel).",
        json_schema_extra=OPERATIONAL,
    )
