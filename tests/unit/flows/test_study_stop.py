"""Ctrl-C (or SIGTERM) on a study: the main thread's interrupt sets torchrun.STOP, which the points' trainers
(launched from worker threads, which signals never reach) stop on, and no further point starts."""

import os
import signal
import threading
import time

import pytest

from difflm.config import load_study
from difflm.flows import study as study_flow
from difflm.models.launch import torchrun

SPEC = """
preset: test-tiny
base: [tracking.enabled=false]
families: {masked: [], ar: [diffusion.model_running_mode=ar]}
unique_tokens: [1000]
epochs: [1, 2]
parallel: 1
"""


def test_an_interrupted_study_stops_its_trainers_and_starts_no_other_point(tmp_path, monkeypatch):
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(SPEC)
    spec = load_study(spec_file)
    started: list[str] = []
    stopped = threading.Event()

    def point(spec, p, i, n, parent, say):  # the first point "trains" until the stop reaches it
        started.append(p.label)
        time.sleep(
            0.5
        )  # the main thread past starting this thread, waiting for the points (as a user's Ctrl-C finds it)
        os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C, to the process (its main thread)
        if torchrun.STOP.wait(timeout=30):
            stopped.set()
        return {}

    monkeypatch.setattr(study_flow, "_run_point", point)
    # Ctrl-C as in a terminal: a process started in the background by a non-interactive shell (`cmd &`, as a CI
    # runner may start the tests) inherits SIGINT ignored, and Python then installs no handler for it
    interactive = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            study_flow.run_study(spec, lambda line: None)
        assert started == ["masked-u1000-e1"] and stopped.is_set()  # the 3 other points never started
    finally:
        signal.signal(signal.SIGINT, interactive)
        torchrun.STOP.clear()
