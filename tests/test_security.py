"""Each reproduction of the security review (issue 22) fails safely against the code: injected sbatch values,
folders deleted that are not ours, pickles read from shared folders, oversize JSONL lines, a full disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from difflm.config import ConfigError, load_config
from models.launch.cluster import slurm_script

RUN = Path("/shared/difflm/runs/difflm-noshift-abc-def")


# ---- values reaching a shell (review H3) ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, field",
    [
        ('train.slurm.sbatch_args={account: "proj\\ncurl -s http://127.0.0.1:9/x | sh #"}', "train.slurm.sbatch_args"),
        ('train.slurm.sbatch_args={"acc\\nid #": proj}', "train.slurm.sbatch_args"),
        ('train.slurm.sbatch_args={account: "$(id)"}', "train.slurm.sbatch_args"),
        ('train.slurm.time="01:00:00\\ntouch $SCRATCH/PWNED_time"', "train.slurm.time"),
        ("train.slurm.time=tomorrow", "train.slurm.time"),
        ('train.slurm.partition="gpu --wrap=id"', "train.slurm.partition"),
        ('data.slurm.sbatch_args={qos: "high\\nid"}', "data.slurm.sbatch_args"),
        ('workdir="/shared/difflm\\ntouch $SCRATCH/PWNED_workdir\\n"', "workdir"),
    ],
)
def test_injected_sbatch_values_are_config_errors(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config("test-tiny", [override])


@pytest.mark.parametrize("time", ["30", "00:30", "04:00:00", "2-00", "2-12:00", "1-00:00:00", "UNLIMITED"])
def test_slurm_time_formats_are_accepted(time):
    cfg = load_config(
        "test-tiny", [f"train.slurm.time={time}", "train.slurm.sbatch_args={account: proj, constraint: 'a&b', mem: 0}"]
    )
    script = slurm_script(cfg, RUN / "config.yaml", RUN / "data_manifest.json", RUN)
    assert f"#SBATCH --time={time}\n" in script and "#SBATCH --account=proj\n" in script


def test_script_refuses_unsafe_run_dirs_arguments_and_env_keys():
    cfg = load_config("test-tiny", [])
    spaced = Path("/shared/my runs/r")  # a space: the #SBATCH value is double-quoted, the shell's single-quoted
    assert '#SBATCH --output="/shared/my runs/r/slurm-%j.out"' in slurm_script(cfg, spaced / "c", spaced / "m", spaced)
    quoted = Path('/shared/a"b/r')
    with pytest.raises(ConfigError, match="workdir"):
        slurm_script(cfg, quoted / "c.yaml", quoted / "m.json", quoted)
    with pytest.raises(ConfigError, match="train.slurm"):
        slurm_script(cfg, RUN / "c.yaml", RUN / "m.json", RUN, time="1:00:00\nid")
    with pytest.raises(ConfigError, match="not an identifier"):
        slurm_script(cfg, RUN / "c.yaml", RUN / "m.json", RUN, env={"BAD;touch $SCRATCH/PWNED_envkey;X": "v"})
    script = slurm_script(cfg, RUN / "c.yaml", RUN / "m.json", RUN, env={"MLFLOW_TRACKING_URI": "http://x;id"})
    assert "export MLFLOW_TRACKING_URI='http://x;id'\n" in script
