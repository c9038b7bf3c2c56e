"""Each reproduction of the security review fails safely against the code: injected sbatch values,
folders deleted that are not ours, pickles read from shared folders, oversize JSONL lines, a full disk."""

from __future__ import annotations

import errno
import gzip
import importlib
import json
import os
import pickle
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import datatrove.executor.slurm as datatrove_slurm
import pytest
import torch
from fault_injection import fault_launch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from prefect import flow, task
from prefect.results import ResultRecord, ResultRecordMetadata
from prefect.serializers import PickleSerializer
from prefect.settings import get_current_settings
from torch.distributed.checkpoint.planner import WriteItemType

from deploy import mlflow_auth, stack
from difflm.config import ConfigError, load_config
from difflm.data_prep import pipeline
from difflm.data_prep import slurm as prep_slurm
from difflm.errors import DiskFull, UserError
from difflm.flows import cli
from difflm.flows.cli import main
from difflm.models.evaluation.stages import load_model
from difflm.models.hf.convert import check_replaceable, hf_config, import_hf, load_megatron_weights, save_export
from difflm.models.hf.export import Export
from difflm.models.hf.modeling_difflm import DiffLMForMaskedLM
from difflm.models.launch import slurm as slurm_launch
from difflm.models.launch.cluster import sbatch_command, sbatch_options, slurm_script
from difflm.models.launch.slurm import write_credentials
from difflm.models.launch.torchrun import launch_training, run_dir
from difflm.models.megatron import checkpointing
from difflm.models.megatron.safe_pickle import UnsafeCheckpoint, guard_dcp, restricted_loads
from difflm.outputs import OutputInTheWay, staged_output
from difflm.rundir import RunDir
from difflm.tasks.cache import run_stage

RUN = Path("/shared/difflm/runs/difflm-noshift-abc-def")


# ---- values reaching a shell ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, field",
    [
        (
            'train.launch.slurm.sbatch_args={account: "proj\\ncurl -s http://127.0.0.1:9/x | sh #"}',
            "train.launch.slurm.sbatch_args",
        ),
        ('train.launch.slurm.sbatch_args={"acc\\nid #": proj}', "train.launch.slurm.sbatch_args"),
        ('train.launch.slurm.sbatch_args={account: "$(id)"}', "train.launch.slurm.sbatch_args"),
        ('train.launch.slurm.time="01:00:00\\ntouch $SCRATCH/PWNED_time"', "train.launch.slurm.time"),
        ("train.launch.slurm.time=tomorrow", "train.launch.slurm.time"),
        ('train.launch.slurm.partition="gpu --wrap=id"', "train.launch.slurm.partition"),
        ('data.slurm.sbatch_args={qos: "high\\nid"}', "data.slurm.sbatch_args"),
        ('workdir="/shared/difflm\\ntouch $SCRATCH/PWNED_workdir\\n"', "workdir"),
    ],
)
def test_injected_sbatch_values_are_config_errors(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config("test-tiny", [override])


@pytest.mark.parametrize(
    "option",
    [
        "{export: 'ALL,BASH_ENV=evil.sh'}",
        "{output: /root/.bashrc}",
        "{error: /etc/cron.d/x}",
        "{wrap: id}",
        "{chdir: /tmp}",
        "{'--export': NONE}",
        "{get-user-env: ''}",
        "{container: /tmp/x}",
    ],
)
@pytest.mark.parametrize("section", ["train.launch.slurm", "data.slurm"])
def test_sbatch_args_outside_the_scheduling_options_are_refused(section, option):
    with pytest.raises(ConfigError) as err:
        load_config("test-tiny", [f"{section}.sbatch_args={option}"])
    msg = str(err.value)
    assert f"{section}.sbatch_args" in msg and "is not one sbatch_args may set" in msg
    assert "allowed: account, begin, " in msg and "qos" in msg and len(msg.splitlines()) == 2  # heading, field


@pytest.mark.parametrize(
    "option", ["{mem: lots}", "{nodes: two}", "{cpus-per-task: -1}", "{gpus: 'a100:x'}", "{nice: high}"]
)
def test_sbatch_args_values_are_checked_for_their_options_shape(option):
    with pytest.raises(ConfigError, match=r"train\.launch\.slurm\.sbatch_args.* is not a value of --"):
        load_config("test-tiny", [f"train.launch.slurm.sbatch_args={option}"])


def test_scheduling_sbatch_args_pass():
    args = "{account: proj, qos: high, gres: 'gpu:a100:4', gpus-per-node: 4, nodes: 2, ntasks-per-node: 1, "
    args += "cpus_per_task: 32, mem: 0, mem-per-cpu: 4G, exclusive: '', begin: 'now+1hour', nice: 10, "
    args += "mail-type: 'END,FAIL', mail-user: me@example.org, reservation: maint, constraint: 'a100|h100'}"
    cfg = load_config("test-tiny", [f"train.launch.slurm.sbatch_args={args}"])
    options = sbatch_options(cfg)
    assert "--cpus-per-task=32" in options and "--exclusive" in options and "--gres=gpu:a100:4" in options


def test_the_jobs_python_must_be_an_executable_file(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.launch\.slurm\.python.*not an absolute path"):
        load_config("test-tiny", ["train.launch.slurm.python=python3"])
    data = tmp_path / "notes.txt"
    data.write_text("")
    for python in ("/nonexistent/python", str(data), str(tmp_path)):
        cfg = load_config("test-tiny", [f"train.launch.slurm.python={python}"])
        with pytest.raises(ConfigError, match=r"train\.launch\.slurm\.python=.* is not an executable file"):
            slurm_script(cfg, RUN / "config.yaml", RUN / "data_manifest.json", RUN)
    cfg = load_config("test-tiny", [f"train.launch.slurm.python={sys.executable}"])
    assert sys.executable in slurm_script(cfg, RUN / "config.yaml", RUN / "data_manifest.json", RUN)


@pytest.mark.integration  # runs each candidate once with -c, as the check does
def test_the_jobs_python_must_be_a_python_interpreter(tmp_path, monkeypatch):
    # issue 50 item 6a: /bin/sh (or any executable) was accepted as the job's python
    monkeypatch.setattr(slurm_launch, "PYTHON_PROBE_TIMEOUT", 2)
    hangs = tmp_path / "hangs"
    hangs.write_text("#!/bin/sh\nsleep 30\n")
    old = tmp_path / "python3.8"
    old.write_text("#!/bin/sh\necho '(3, 8)'\n")
    for fake in (hangs, old):
        fake.chmod(0o755)
    for python, why in (
        ("/bin/sh", "is not a Python interpreter"),
        (hangs, "did not answer"),
        (old, "is Python 3.8, not 3.11"),
    ):
        cfg = load_config("test-tiny", [f"train.launch.slurm.python={python}"])
        with pytest.raises(ConfigError) as err:
            slurm_script(cfg, RUN / "config.yaml", RUN / "data_manifest.json", RUN)
        line = str(err.value)
        assert "\n" not in line and f"train.launch.slurm.python={str(python)!r}" in line and why in line
    wrapper = tmp_path / "python"  # another path to a real python (a venv's link, a module's wrapper) is accepted
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    cfg = load_config("test-tiny", [f"train.launch.slurm.python={wrapper}"])
    assert str(wrapper) in slurm_script(cfg, RUN / "config.yaml", RUN / "data_manifest.json", RUN)


@pytest.mark.parametrize("time", ["30", "00:30", "04:00:00", "2-00", "2-12:00", "1-00:00:00", "UNLIMITED"])
def test_slurm_time_formats_are_accepted(time):
    cfg = load_config(
        "test-tiny",
        [
            f"train.launch.slurm.time={time}",
            "train.launch.slurm.sbatch_args={account: proj, constraint: 'a&b', mem: 0}",
        ],
    )
    script = slurm_script(cfg, RUN / "config.yaml", RUN / "data_manifest.json", RUN)
    # sbatch's arguments, not lines of the script
    assert sbatch_command(cfg, RUN / "launch.sbatch")[1:4] == [f"--time={time}", "--account=proj", "--constraint=a&b"]
    assert "--time" not in script and "--account" not in script


def test_script_refuses_unsafe_run_dirs_arguments_and_env_keys():
    cfg = load_config("test-tiny", [])
    spaced = Path("/shared/my runs/r")  # a space: the #SBATCH value is double-quoted, the shell's single-quoted
    assert '#SBATCH --output="/shared/my runs/r/slurm-%j.out"' in slurm_script(cfg, spaced / "c", spaced / "m", spaced)
    quoted = Path('/shared/a"b/r')
    with pytest.raises(ConfigError, match="workdir"):
        slurm_script(cfg, quoted / "c.yaml", quoted / "m.json", quoted)
    with pytest.raises(ConfigError, match="train.launch.slurm"):
        sbatch_options(cfg, time="1:00:00\nid")
    with pytest.raises(ConfigError, match="not an identifier"):
        slurm_script(cfg, RUN / "c.yaml", RUN / "m.json", RUN, env={"BAD;touch $SCRATCH/PWNED_envkey;X": "v"})
    script = slurm_script(cfg, RUN / "c.yaml", RUN / "m.json", RUN, env={"MLFLOW_TRACKING_URI": "http://x;id"})
    assert "export MLFLOW_TRACKING_URI='http://x;id'\n" in script


def test_credentials_go_to_the_slurm_job_through_a_private_file_not_its_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "pw with 'quotes'\n$(id)")
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "admin:s3cret")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # not a credential
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    env = write_credentials(run, {"HF_TOKEN": "hf_x", "DIFFLM_MLFLOW_RUN_ID": "abc"})
    path = Path(env["DIFFLM_CREDENTIALS_FILE"])
    assert path.parent.parent == run.path and path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert not {"MLFLOW_TRACKING_PASSWORD", "PREFECT_API_AUTH_STRING", "HF_TOKEN"} & set(env)
    assert env["TOKENIZERS_PARALLELISM"] == "false"
    read = dict(word.split("=", 1) for word in shlex.split(path.read_text()))  # what the job's shell reads
    assert read["MLFLOW_TRACKING_PASSWORD"] == "pw with 'quotes'\n$(id)" and read["HF_TOKEN"] == "hf_x"
    assert read["DIFFLM_CREDENTIAL_NAMES"] == "HF_TOKEN MLFLOW_TRACKING_PASSWORD PREFECT_API_AUTH_STRING"
    cfg = load_config("test-tiny", [])
    script = slurm_script(cfg, RUN / "c.yaml", RUN / "m.json", RUN, env={"HF_TOKEN": "hf_x", "A": "1"})
    assert "hf_x" not in script and "export A=1" in script and '. "$DIFFLM_CREDENTIALS_FILE"' in script
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")
    monkeypatch.delenv("PREFECT_API_AUTH_STRING")
    assert "DIFFLM_CREDENTIALS_FILE" not in write_credentials(run, {}) and not path.exists()  # none: no file


# ---- deleting only our own folders ---------------------------------------------------------------------------


def _dataset(root: Path) -> Path:
    ds = root / "mydataset"
    (ds / "images").mkdir(parents=True)
    (ds / "metadata.json").write_text("{}")  # a common name: no proof the folder is ours
    (ds / "labels.csv").write_text("id,label\n1,cat\n")
    (ds / "images" / "0001.png").write_bytes(b"\x89PNG")
    return ds


def test_convert_out_never_replaces_a_folder_without_our_marker(tmp_path):
    ds = _dataset(tmp_path)
    for kind in ("hf", "megatron"):
        with pytest.raises(UserError, match="nothing in it was deleted"):
            check_replaceable(ds, kind)
    hf = tmp_path / "hf_export"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"")
    (hf / "config.json").write_text("{}")
    cfg = load_config("test-tiny", [f"workdir={tmp_path / 'work'}"])
    with pytest.raises(UserError, match="mydataset exists and is not a megatron checkpoint import"):
        import_hf(cfg, hf, ds, {"vocab_size": 512, "mask_id": 1, "eos_id": 0, "pad_id": 2})
    assert (ds / "labels.csv").exists() and (ds / "images" / "0001.png").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_export", "mydataset"]  # no .part left behind


def test_staged_output_replaces_only_marked_folders_and_cleans_up(tmp_path):
    out = tmp_path / "export"
    with staged_output(out, "difflm_export.json") as tmp:
        (tmp / "difflm_export.json").write_text("{}")
        (tmp / "v1").write_text("1")
    with staged_output(out, "difflm_export.json") as tmp:  # an earlier export of ours: replaced
        (tmp / "difflm_export.json").write_text("{}")
        (tmp / "v2").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == ["difflm_export.json", "v2"]
    with pytest.raises(ZeroDivisionError), staged_output(out, "difflm_export.json") as tmp:
        (tmp / "half").write_text("")
        raise ZeroDivisionError  # a failed write leaves the earlier output and no partial folder
    assert sorted(p.name for p in out.iterdir()) == ["difflm_export.json", "v2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    stale = tmp_path / "export.part"  # a folder named like our old temporary one is not deleted either
    stale.mkdir()
    (stale / "keep").write_text("")
    ds = _dataset(tmp_path)
    with pytest.raises(OutputInTheWay), staged_output(ds, "difflm_export.json"):
        pass
    assert (stale / "keep").exists() and (ds / "labels.csv").exists()


# ---- no blind unpickling of shared folders -------------------------------------------------------------------


class _Payload:
    def __init__(self, mark: Path):
        self.mark = mark

    def __reduce__(self):
        return (os.system, (f"id > {self.mark}",))


def _crafted_checkpoint(root: Path, mark: Path) -> Path:
    ck = root / "evil_ckpt" / "iter_0000020"
    ck.mkdir(parents=True)
    backends = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch"}
    (ck / "metadata.json").write_text(json.dumps({**backends, "common_backend_version": 1}))
    (ck / ".metadata").write_bytes(pickle.dumps(_Payload(mark)))
    return ck


def test_crafted_dcp_metadata_is_refused_without_running_code(tmp_path):
    mark = tmp_path / "PWNED_dcp_metadata"
    ck = _crafted_checkpoint(tmp_path, mark)
    with pytest.raises(UnsafeCheckpoint, match="posix.system.*refused without running it.*checkpoints you trust"):
        load_megatron_weights(ck)
    assert not mark.exists()


@pytest.mark.integration  # the CLI in a subprocess
def test_convert_cli_refuses_a_crafted_checkpoint_in_one_line(tmp_path):
    mark = tmp_path / "PWNED_cli"
    ck = _crafted_checkpoint(tmp_path, mark)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(
        [sys.executable, "-m", "difflm.flows.cli", "convert", str(ck), "--out", str(tmp_path / "out"),
         f"workdir={tmp_path / 'work'}"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0 and not mark.exists(), proc.stderr
    assert "Traceback" not in proc.stderr and "refused without running it" in proc.stderr, proc.stderr


class _ByName:
    """Pickles as `getattr(target, name)`, the way some Pythons write an enum member."""

    def __init__(self, target, name):
        self.target, self.name = target, name

    def __reduce__(self):
        return (getattr, (self.target, self.name))


def test_an_enum_member_pickled_by_name_loads_and_other_getattrs_are_refused():
    """Python 3.11.2 (Debian bookworm, the Docker base) writes DCP's enums as `getattr(WriteItemType, 'TENSOR')`:
    the restricted unpickler refused `builtins.getattr` and no checkpoint written there converted. getattr is
    allowed for an allowed enum's members only: reaching a function or module from an allowed class is refused."""
    assert restricted_loads(pickle.dumps(_ByName(WriteItemType, "TENSOR"))) is WriteItemType.TENSOR
    for target, name in [(WriteItemType, "__init__"), (WriteItemType, "__class__"), (torch.Size, "__init__")]:
        with pytest.raises(UnsafeCheckpoint, match="refused without running it"):
            restricted_loads(pickle.dumps(_ByName(target, name)))


def test_real_dcp_metadata_loads_through_the_restricted_unpickler(tmp_path, megatron_single_process):
    guard_dcp()
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    sharded = {"w": ShardedTensor.from_rank_offsets("w", state["w"], replica_id=0)}
    dist_checkpointing.save(sharded, str(tmp_path))
    empty = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), replica_id=0)}
    assert torch.equal(dist_checkpointing.load(empty, str(tmp_path))["w"], state["w"])


def test_crafted_rng_file_is_refused(tmp_path, megatron_single_process):
    mark = tmp_path / "PWNED_rng"
    (tmp_path / "rng").mkdir()
    (tmp_path / "rng" / "rank00000.pt").write_bytes(pickle.dumps(_Payload(mark)))
    with pytest.raises(pickle.UnpicklingError, match="[Ww]eights only load failed"):
        checkpointing._restore_rng(tmp_path)
    assert not mark.exists()
    torch.save(checkpointing._rng_state(), tmp_path / "rng" / "rank00000.pt")  # a real one loads weights-only
    checkpointing._restore_rng(tmp_path)


# ---- bounded reading ------------------------------------------------------------------------------------------

_READ_PEAK = """
import sys
from difflm.data_prep.readers import JsonlSource
r = JsonlSource(sys.argv[1], glob_pattern="big.jsonl.gz", text_key="text", source="t")
r._logged = 0
skips = []
r.stat_update = lambda key, *a, **k: skips.append(key)
texts = [doc.text for doc in r.read_file("big.jsonl.gz")]
# VmHWM: this process's own peak (ru_maxrss keeps the forking parent's across exec)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(texts, skips, hwm // 1024)
"""


@pytest.mark.integration  # a subprocess with a memory limit
def test_a_huge_line_in_a_tiny_gzip_is_a_counted_skip_in_bounded_memory(tmp_path):
    path = tmp_path / "big.jsonl.gz"
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(b'{"text": "before"}\n{"text": "')
        chunk = b"a" * (1 << 20)
        for _ in range(256):  # one 256 MiB line
            f.write(chunk)
        f.write(b'"}\n{"text": "after"}\n')
    assert path.stat().st_size < 2 << 20
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(
        [sys.executable, "-c", _READ_PEAK, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    texts, skips, peak_mib = proc.stdout.strip().rsplit(" ", 1)[0], proc.stdout, int(proc.stdout.split()[-1])
    assert "['before', 'after']" in texts and "skipped_oversize_record" in skips
    assert "big.jsonl.gz:2" in proc.stderr and "oversize record" in proc.stderr  # where, in the log
    print("peak RSS MiB", peak_mib)
    assert peak_mib < 600, f"peak RSS {peak_mib} MiB reading a 256 MiB line (unbounded: ~1.45 GB)"


_READ_CAPPED = """
import sys
from difflm.data_prep.readers import JsonlSource
r = JsonlSource(sys.argv[1], glob_pattern="*.jsonl*", text_key="text", source="t")
r._logged, r.max_file_bytes = 0, 16 << 20
skips = []
r.stat_update = lambda key, *a, **k: skips.append(key)
counts = {name: sum(1 for _ in r.read_file(name)) for name in ("many.jsonl.gz", "plain.jsonl")}
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(counts, skips, hwm // 1024)
"""


@pytest.mark.integration  # a subprocess with a memory limit
def test_a_file_past_the_per_file_cap_is_a_counted_skip_in_bounded_memory(tmp_path):
    """64 MiB of short lines in a small gzip, read with a 16 MiB cap per file: the lines before the cap are
    kept, the rest is one counted skip naming the file; a plain file over the cap is not read at all."""
    line = b'{"text": "' + b"b" * 1000 + b'"}\n'  # 1012 bytes
    with gzip.open(tmp_path / "many.jsonl.gz", "wb", compresslevel=1) as f:
        for _ in range(64):  # 64 MiB decompressed
            f.write(line * 1036)
    (tmp_path / "plain.jsonl").write_bytes(line * (17 * 1036))  # just over 16 MiB
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(
        [sys.executable, "-c", _READ_CAPPED, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    counts, peak_mib = proc.stdout.split("}", 1)[0] + "}", int(proc.stdout.split()[-1])
    kept = (16 << 20) // len(line)
    assert counts == f"{{'many.jsonl.gz': {kept}, 'plain.jsonl': 0}}", proc.stdout
    assert proc.stdout.count("skipped_oversize_file") == 2, proc.stdout
    assert "skipping file many.jsonl.gz: oversize file (decompressed past 16777216 bytes" in proc.stderr
    assert "skipping file plain.jsonl: oversize file" in proc.stderr and "not read" in proc.stderr
    print("peak RSS MiB", peak_mib)
    assert peak_mib < 400, f"peak RSS {peak_mib} MiB reading 64 MiB of lines: not flat"


# ---- a full disk is one line ------------------------------------------------------------------------------------


def _enospc(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/shard_00001.bin")


def test_disk_full_during_data_prep_is_one_line(tmp_path, tiny_manifest, monkeypatch, capsys):
    cfg = load_config("test-tiny", [f"workdir={tmp_path}"])
    monkeypatch.setattr(pipeline, "run_pipeline", _enospc)
    with pytest.raises(DiskFull, match=r"no space left on the device of .*/data/\w+ while preparing data: free"):
        pipeline.prepare_data(cfg)
    assert main(["prep", f"workdir={tmp_path}"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("difflm: no space left") and "\n" not in err and "Traceback" not in err
    assert "rerun the same command: data prep starts again where it stopped" in err


def test_disk_full_anywhere_under_the_cli_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "resolve_config", _enospc)
    assert cli.main(["config", "show"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("difflm: no space left on the device of /data while writing /data/shard_00001.bin")
    assert "\n" not in err


@pytest.mark.slow
def test_disk_full_during_a_checkpoint_save_is_one_line_and_the_rerun_resumes(tmp_path, tiny_manifest):
    cfg = load_config(
        "test-tiny",
        [f"workdir={tmp_path}", "train.train_iters=8", "checkpoint.save_interval=4", "train.schedule.warmup_iters=1"],
    )
    with pytest.raises(DiskFull) as err:
        launch_training(cfg, tiny_manifest, echo=lambda _: None, **fault_launch(disk_full_at=8))
    assert "\n" not in str(err.value) and "while training (saving a checkpoint" in str(err.value)
    assert "training resumes from iteration 4" in str(err.value)
    info = launch_training(cfg, tiny_manifest, echo=lambda _: None)  # space freed: resumes and finishes
    assert "start_iter=4" in (run_dir(cfg, tiny_manifest) / "train.log").read_text()
    assert info.checkpoint.name == "iter_0000008"


# ---- difflm eval never runs an export's code -----------------------------------------------------------------


def test_the_pipeline_loader_never_runs_an_exports_code(tmp_path):
    cfg = load_config("test-tiny", [])
    model = DiffLMForMaskedLM(hf_config(cfg, {"vocab_size": 64, "mask_id": 1, "eos_id": 0, "pad_id": 2}))
    (tmp_path / "tokenizer").mkdir()
    hf = save_export(model, tmp_path / "tokenizer", Export(tmp_path / "hf", None)).folder
    mark = tmp_path / "PWNED_remote_code"
    payload = f"\nimport pathlib\npathlib.Path({str(mark)!r}).write_text('ran')\n"
    for name in ("modeling_difflm.py", "configuration_difflm.py"):
        with (hf / name).open("a") as fh:
            fh.write(payload)
    sys.path.insert(0, str(tmp_path))  # the export folder as a (namespace) package: its relative imports resolve
    try:
        importlib.import_module("hf.configuration_difflm")  # the payload works when the file runs ...
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == "hf" or m.startswith("hf.")]:
            del sys.modules[name]
    assert mark.exists()
    mark.unlink()
    loaded = load_model(hf)  # ... and `difflm eval`'s loader never runs it: this project's class, the weights
    assert type(loaded) is DiffLMForMaskedLM and not mark.exists()


def test_the_stack_starts_its_services_with_a_private_umask(monkeypatch, tmp_path):
    seen = []

    def up(*_, **__):
        mask = os.umask(0)
        os.umask(mask)
        seen.append(mask)
        raise SystemExit("stop here")

    monkeypatch.setattr(stack, "up", up)
    monkeypatch.setattr(stack, "down", lambda _dir: [])
    before = os.umask(0o002)
    try:
        with pytest.raises(SystemExit, match="stop here"):
            stack.main(["up", "--dir", str(tmp_path / "s"), "--env-file", str(tmp_path / ".env")])
        assert seen == [0o027]  # the services and the worker's trainers inherit it
        assert os.umask(0o002) == 0o002  # an in-process caller keeps its own
        assert (tmp_path / ".env").stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(before)


def test_stack_down_removes_the_mlflow_auth_ini_it_wrote(monkeypatch, tmp_path):
    # issue 50 item 6c: the auth app's ini (0600, the auth database's password in its URI) stayed in /tmp after down
    started = {}
    monkeypatch.setattr(stack, "_start", lambda name, argv, env, state, cwd: started.setdefault(name, env))
    monkeypatch.setattr(stack, "_wait", lambda *_: None)
    state = tmp_path / "state"
    (state / "logs").mkdir(parents=True)
    (state / "logs" / "mlflow.log").write_text("kept")
    stack.start_servers(stack.Stack({k: "pw" + k.lower() for k in stack.SECRETS}), state, timeout=1)

    def exec_(*_):
        raise SystemExit("the server would start here")

    for key, value in started["mlflow"].items():  # deploy.mlflow_auth as the native start runs it
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(mlflow_auth.os, "execv", exec_)
    monkeypatch.setattr(mlflow_auth.os, "execvp", exec_)
    with pytest.raises(SystemExit, match="would start"):
        mlflow_auth.main(["mlflow", "server"])
    ini = Path(os.environ["MLFLOW_AUTH_CONFIG_PATH"])
    try:
        assert "pwmlflow_db_password" in ini.read_text() and ini.stat().st_mode & 0o777 == 0o600
        stack.down(state)
        assert not ini.exists() and (state / "logs" / "mlflow.log").read_text() == "kept"
    finally:
        if tmp_path not in ini.parents:  # written elsewhere (the temp folder): not left behind by this test
            shutil.rmtree(ini.parent, ignore_errors=True)


def test_the_cli_writes_with_a_private_umask(monkeypatch):
    seen = []

    def resolve(*_):
        mask = os.umask(0)
        os.umask(mask)
        seen.append(mask)
        raise UserError("stop here")

    monkeypatch.setattr(cli, "resolve_config", resolve)
    before = os.umask(0o002)
    try:
        assert cli.main(["config", "show"]) == 1
        assert seen == [0o027] and os.umask(0o002) == 0o002  # restored after the command
    finally:
        os.umask(before)


class _Boom:
    def __init__(self, mark: str):
        self.mark = mark

    def __reduce__(self):
        return (os.system, (f"touch {self.mark}",))


def test_a_planted_pickle_result_is_never_read(tmp_path, prefect_harness):
    @task
    def stage(x: int) -> dict:
        return {"x": x, "path": str(tmp_path)}

    key = "security-test-" + tmp_path.name
    storage = Path(get_current_settings().results.local_storage_path)
    storage.mkdir(parents=True, exist_ok=True)
    mark = tmp_path / "PWNED_result"
    record = ResultRecord(
        result=_Boom(str(mark)),
        metadata=ResultRecordMetadata(storage_key=str(storage / key), serializer=PickleSerializer()),
    )
    (storage / key).write_bytes(record.serialize())  # a record naming `pickle`, written into the workdir

    @flow
    def pipeline() -> tuple:
        return run_stage(stage, key, True, 3)  # done=True: a cache hit would be taken

    result, cached = pipeline()
    assert not mark.exists() and result == {"x": 3, "path": str(tmp_path)} and not cached
    assert pipeline() == (result, True)  # our own JSON record is a cache hit


@pytest.mark.integration  # a stand-in sbatch and the jobs' shell line run as processes
def test_data_prep_submits_to_slurm_without_credentials_and_its_jobs_read_them_from_a_private_file(
    tmp_path, monkeypatch
):
    """datatrove submits with `--export=ALL`: Slurm would store the credentials with the job. Every datatrove
    submission goes through difflm.data_prep.slurm.submit_batch, whose sbatch has none; the jobs' first line reads them
    from the prep's 0600 file (quotes and `$(...)` stay data) and names them in the log, not echoing them."""
    assert datatrove_slurm.launch_slurm_job is prep_slurm.submit_batch
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text(f'#!/bin/sh\nenv > {tmp_path}/sbatch.env\necho "Submitted batch job 42"\n')
    (fake / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws 'key'\n$(touch pwned)")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # not a credential
    assert prep_slurm.submit_batch("#!/bin/bash\n", lambda out: out.split()[-1], "--export=ALL") == "42"
    seen = (tmp_path / "sbatch.env").read_text()
    assert "AWS_SECRET_ACCESS_KEY" not in seen and "TOKENIZERS_PARALLELISM=false" in seen

    cfg = load_config("test-tiny", [f"workdir={tmp_path}", "data.executor=slurm", "data.slurm.partition=debug"])
    out = tmp_path / "prep"
    executor = prep_slurm.slurm_executor(cfg, [], out)
    creds = out / ".credentials" / "slurm-prep.env"
    assert creds.stat().st_mode & 0o777 == 0o600 and creds.parent.stat().st_mode & 0o777 == 0o700
    line = executor.env_command
    job = subprocess.run(
        ["bash", "-c", f'{line}\nprintf %s "$AWS_SECRET_ACCESS_KEY"'], capture_output=True, text=True, cwd=tmp_path
    )
    assert job.stdout.endswith("aws 'key'\n$(touch pwned)") and not (tmp_path / "pwned").exists()
    assert f"difflm: credentials read from {creds}: AWS_SECRET_ACCESS_KEY\n" in job.stdout
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    prep_slurm.slurm_executor(cfg, [], out)  # a rerun without credentials: the queued jobs' file stays
    assert creds.exists()
    prep_slurm.forget_credentials(out)
    assert not creds.exists()
    job = subprocess.run(["bash", "-c", f"{line}\necho ok"], capture_output=True, text=True, cwd=tmp_path)
    assert job.returncode == 0 and job.stdout == "ok\n"  # no file: nothing to read


def _planted_json_record(storage: Path, key: str, serializer: dict, result: str) -> None:
    """A record that says it is JSON, written into the workdir's result store by someone else."""
    meta = {
        "storage_key": str(storage / key),
        "expiration": None,
        "serializer": serializer,
        "prefect_version": "3.9.1",
        "storage_block_id": None,
    }
    storage.mkdir(parents=True, exist_ok=True)
    (storage / key).write_text(json.dumps({"metadata": meta, "result": result}))


OUR_JSON = {
    "type": "json",
    "jsonlib": "json",
    "object_encoder": "prefect.serializers.prefect_json_object_encoder",
    "object_decoder": "prefect.serializers.prefect_json_object_decoder",
    "dumps_kwargs": {},
    "loads_kwargs": {},
}


@pytest.mark.parametrize(
    "serializer, payload",
    [
        # Prefect calls the named decoder on every JSON object: subprocess.run takes the dict's keys as argv
        ({**OUR_JSON, "object_decoder": "subprocess.run"}, {"touch": 1, "MARK": 2}),
        ({**OUR_JSON, "jsonlib": "subprocess"}, {"x": 1}),
        ({**OUR_JSON, "loads_kwargs": {"object_hook": "subprocess.run"}}, {"touch": 1, "MARK": 2}),
        # our own decoder, told to build an object of a class outside difflm: it imports and calls it
        (OUR_JSON, {"__class__": "subprocess.Popen", "data": ["touch", "MARK"]}),
    ],
    ids=["object_decoder", "jsonlib", "loads_kwargs", "foreign_class"],
)
def test_a_planted_json_record_runs_nothing(tmp_path, prefect_harness, serializer, payload):
    """The JSON serializer is no guard by itself: the record names its decoder (any importable callable) and
    the classes it builds. Only records in exactly our serializer naming only our classes are read."""

    @task
    def stage(x: int) -> dict:
        return {"x": x}

    key = f"security-json-{tmp_path.name}"
    storage = Path(get_current_settings().results.local_storage_path)
    mark = tmp_path / "PWNED_json"
    blob = json.dumps(payload).replace("MARK", str(mark))
    _planted_json_record(storage, key, serializer, blob)

    @flow
    def pipeline() -> tuple:
        return run_stage(stage, key, True, 3)

    result, cached = pipeline()
    assert not mark.exists(), "a planted record ran a command"
    assert result == {"x": 3} and not cached
