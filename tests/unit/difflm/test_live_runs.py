"""The records of the commands running on a workdir (difflm.live_runs): a live command's record is never taken for
a dead one's, a dead one's is found with what it started, and a command that ends removes its own."""

from __future__ import annotations

import json
import os
import socket

import pytest

from difflm import live_runs
from difflm.errors import UserError
from difflm.tracking.dead_runs import without_userinfo


def test_a_live_commands_record_is_not_dead_and_is_removed_at_its_end(tmp_path):
    with live_runs.recorded(tmp_path, "run"):
        live_runs.note_mlflow_run("abc", "sqlite:///x.db")
        live_runs.note_flow_run("f-1")
        live_runs.note_mlflow_run("abc", "sqlite:///x.db")  # noted once
        (path,) = (tmp_path / live_runs.LIVE).glob("*.json")
        record = json.loads(path.read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        assert record["mlflow_runs"] == {"abc": "sqlite:///x.db"} and record["flow_runs"] == ["f-1"]
        with live_runs.dead_records(tmp_path) as dead:  # its flock is held: alive, whoever asks
            assert dead == []
    assert not list((tmp_path / live_runs.LIVE).glob("*.json"))
    live_runs.note_flow_run("f-2")  # outside a recorded command: nothing, no error


def test_a_killed_commands_record_is_found_with_what_it_started(tmp_path):
    folder = tmp_path / live_runs.LIVE
    folder.mkdir()
    left = {"pid": 4242, "host": "node1", "since": 0.0, "command": "run"}
    left |= {"mlflow_runs": {"r1": "sqlite:///m.db"}, "flow_runs": ["f-9"]}
    (folder / "node1-4242-aaaaaa.json").write_text(json.dumps(left))  # nobody holds it: its command is gone
    (folder / "node1-4243-bbbbbb.json").write_text("")  # killed before it wrote anything: removed, nothing to mark
    with live_runs.dead_records(tmp_path) as dead:
        assert [(p.name, r.flow_runs, r.mlflow_runs) for p, r in dead] == [
            ("node1-4242-aaaaaa.json", ["f-9"], {"r1": "sqlite:///m.db"})
        ]
        assert "pid 4242 on node1" in dead[0][1].who()
    assert [p.name for p in folder.iterdir()] == ["node1-4242-aaaaaa.json"]  # kept until the caller handled it


def test_a_planted_link_in_the_records_is_refused(tmp_path):
    folder = tmp_path / live_runs.LIVE
    folder.mkdir()
    (folder / "x.json").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UserError, match="symlink"), live_runs.dead_records(tmp_path):
        pass


def test_a_record_holds_no_credential_of_a_tracking_uri():
    assert without_userinfo("https://alice:<password>@mlflow.example:5000/x") == "https://mlflow.example:5000/x"
    assert without_userinfo("sqlite:////w/mlflow.db") == "sqlite:////w/mlflow.db"
