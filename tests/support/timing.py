"""The suite's time rules beside the unit tier's CPU budget (conftest.py, docs/testing.md):

- a test that takes over LONG_TEST_S of wall time, its set-up included (a module's stack or trained run is paid by
  its first test), must say why: `@pytest.mark.slow(reason="...")`; one that does not fails with what to do. The
  reasons are the list docs/testing.md keeps of the suite's long tests.
- at the end of a run, the time of each tier (unit, integration, slow): its tests' set-up, call and teardown summed
  (over both workers under xdist), and the run's wall time, so a change that makes a tier dearer shows at once.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

import pytest

# Wall seconds, not CPU: a long test mostly waits on its processes. 60 s of a test run alone; under xdist the
# workers share the cores, so the line is 60 s per worker (a 40 s test took 60-80 s beside another on 2 cores). The
# suite's tests over 45 s alone carry their reasons. $DIFFLM_LONG_TEST_S overrides it, 0 turns it off.
LONG_TEST_S = float(os.environ.get("DIFFLM_LONG_TEST_S", "60"))
WORKERS = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
TIERS = ("unit", "integration", "slow")

_setup = pytest.StashKey[float]()
_times: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # tier -> [tests, seconds]
_started = time.monotonic()


def slow_reason(item: pytest.Item) -> str | None:
    """The reason of the test's `slow` mark (its own, its class's or its module's), if one gives it."""
    return next((m.kwargs["reason"] for m in item.iter_markers("slow") if m.kwargs.get("reason")), None)


def load_factor() -> float:
    """How far past the suite's own share the machine is loaded: the 1-minute load average over twice the cores
    (the workers and the processes their tests start), at least 1. The line is the idle machine's: beside other
    work the same tests take several times as long (measured: 127 and 155 s at load 15-30 on 2 cores for tests of
    40-55 s on the idle machine), and a rule about what a test costs must not fail on what the machine's
    neighbours cost. $DIFFLM_LONG_TEST_LOADED=0 keeps the idle line (the rule's own test)."""
    if os.environ.get("DIFFLM_LONG_TEST_LOADED") == "0":
        return 1.0
    return max(1.0, os.getloadavg()[0] / (2 * (os.cpu_count() or 1)))


def check_long(item: pytest.Item, report: pytest.TestReport) -> None:
    """Fail a passing test that took over LONG_TEST_S (set-up and call, the line raised on a loaded machine) without
    a reason for it."""
    if report.when == "setup":
        item.stash[_setup] = report.duration
        return
    if report.when != "call" or not report.passed or not LONG_TEST_S:
        return
    took, load = item.stash.get(_setup, 0.0) + report.duration, load_factor()
    line = LONG_TEST_S * WORKERS * load
    if took > line and slow_reason(item) is None:
        loaded = f", x{load:.1f} for the machine's load" if load > 1 else ""
        report.outcome = "failed"
        report.longrepr = (
            f"this test took {took:.0f} s (set-up included), over {line:.0f} s ({LONG_TEST_S:g} s a worker{loaded}): make it "
            f'cheaper, or mark it @pytest.mark.slow(reason="why it needs this long") and list it in docs/testing.md'
        )


def tier(keywords) -> str:
    """The tier of a test from its report's keywords (its markers' names among them)."""
    return "slow" if "slow" in keywords else "unit" if "unit" in keywords else "integration"


def record(report: pytest.TestReport) -> None:
    """Add a phase of a test (from a worker too: the controller sees every report) to its tier's time."""
    times = _times[tier(report.keywords)]
    times[1] += report.duration
    if report.when == "call" or (report.when == "setup" and not report.passed):
        times[0] += 1


def summary() -> str | None:
    if not _times:
        return None
    parts = [f"{t} {int(_times[t][0])} tests {_times[t][1]:.0f} s" for t in TIERS if t in _times]
    return (
        f"tiers: {', '.join(parts)} (set-up, call and teardown, summed over the workers); "
        f"wall {time.monotonic() - _started:.0f} s"
    )
