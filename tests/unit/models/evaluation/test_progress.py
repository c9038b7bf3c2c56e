"""Evaluation progress: done of total, rate and time left, at most every few seconds and once at the end."""

from __future__ import annotations

from difflm.models.evaluation.progress import Progress


def test_progress_says_done_rate_and_eta_every_few_seconds_and_at_the_end():
    now = [0.0]
    lines: list[str] = []
    progress = Progress("tasks", "requests", lines.append, every_s=10.0, clock=lambda: now[0])
    progress.expect(40)
    for _ in range(3):  # 8 requests every 4 s: a line once 10 s have passed, not every call
        now[0] += 4.0
        progress(8)
    assert lines == ["[eval] tasks: 24/40 requests, 2.00 requests/s, 12 s elapsed, ETA 8 s"]
    progress.expect(8)  # a later call learns of more work
    now[0] += 2.0
    progress(8)
    now[0] += 2.0
    progress(16)
    assert lines[-1] == "[eval] tasks: 48/48 requests, 3.00 requests/s, 16 s elapsed, ETA 0 s"
