"""The long-test rule (tests/support/timing.py) on a loaded machine: the line rises with the load, so a test is
not failed for what the machine's other work cost it."""

from types import SimpleNamespace

import pytest
import timing


class _Item:
    def __init__(self):
        self.stash = pytest.Stash()

    def iter_markers(self, name):
        return iter([])  # no slow mark, no reason


def _check(monkeypatch, took: float, load: float) -> SimpleNamespace:
    monkeypatch.setattr(timing, "LONG_TEST_S", 60.0)
    monkeypatch.setattr(timing, "WORKERS", 2)
    monkeypatch.delenv("DIFFLM_LONG_TEST_LOADED", raising=False)
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(timing.os, "cpu_count", lambda: 2)
    item = _Item()
    timing.check_long(item, SimpleNamespace(when="setup", duration=0.0))
    report = SimpleNamespace(when="call", passed=True, duration=took, outcome="passed", longrepr=None)
    timing.check_long(item, report)
    return report


def test_an_idle_machine_holds_the_line(monkeypatch):
    report = _check(monkeypatch, took=130, load=2.0)
    assert report.outcome == "failed" and "over 120 s (60 s a worker)" in report.longrepr


def test_a_loaded_machine_raises_the_line(monkeypatch):
    assert _check(monkeypatch, took=155, load=30.0).outcome == "passed"  # the CI run of 2026-12-06 beside 3 others
    report = _check(monkeypatch, took=1000, load=16.0)
    assert report.outcome == "failed" and "over 480 s (60 s a worker, x4.0 for the machine's load)" in report.longrepr


def test_the_rules_own_test_can_keep_the_idle_line(monkeypatch):
    monkeypatch.setenv("DIFFLM_LONG_TEST_LOADED", "0")
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (30.0, 30.0, 30.0))
    assert timing.load_factor() == 1.0
