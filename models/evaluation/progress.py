"""Progress of a long evaluation part, shown as training shows its steps: done of total, rate, time left.

Scoring a 135M model's tasks takes minutes on a CPU; without a line in between it looked hung. `Progress` is the
`progress` callback of `Scorer` and `likelihood_bound`: `expect(n)` adds work it learns of (a call knows its
requests only once it has cut them into windows), `progress(n)` counts work done; a line at most every
`every_s` seconds and one at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Progress:
    def __init__(
        self,
        label: str,
        unit: str,
        echo: Callable[[str], None],
        every_s: float = 10.0,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.label, self.unit, self.echo, self.every_s, self.clock = label, unit, echo, every_s, clock
        self.total = self.done = 0
        self.start = self.last = clock()

    def expect(self, n: int) -> None:
        self.total += n

    def __call__(self, n: int = 1) -> None:
        self.done += n
        now = self.clock()
        if now - self.last >= self.every_s or (self.total and self.done >= self.total):
            self.last = now
            self.echo(self.line(now))

    def line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        left = (self.total - self.done) / rate if rate and self.total >= self.done else 0.0
        return (
            f"[eval] {self.label}: {self.done}/{self.total} {self.unit}, {rate:.2f} {self.unit}/s, "
            f"{elapsed:.0f} s elapsed, ETA {left:.0f} s"
        )
