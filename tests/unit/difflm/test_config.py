import re
import subprocess
import sys
from pathlib import Path

import pytest

from difflm.config import CONFIG_DIR, ConfigError, PipelineConfig, load_config, save_config

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("preset", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_every_preset_validates(preset):
    cfg = load_config(preset)
    assert cfg.name == preset


def test_overrides_are_typed():
    cfg = load_config(
        "tiny-cpu",
        [
            "train.optimizer.lr=1e-3",
            "model.num_layers=6",
            "model.qk_layernorm=true",
            "data.sources=[a.jsonl, b.jsonl]",
            "data.max_documents=null",
        ],
    )
    assert cfg.train.optimizer.lr == 1e-3 and cfg.model.num_layers == 6 and cfg.model.qk_layernorm is True
    assert [s.path for s in cfg.data.sources] == ["a.jsonl", "b.jsonl"] and cfg.data.max_documents is None


def test_invalid_value_names_field_and_allowed_values():
    with pytest.raises(ConfigError) as err:
        load_config("tiny-cpu", ["diffusion.model_running_mode=difflm-typo"])
    msg = str(err.value)
    assert "diffusion.model_running_mode" in msg and "'difflm-noshift'" in msg and "'ar'" in msg


def test_renamed_eval_field_says_what_to_do():
    """The setting eval.max_documents counted seq_length windows; it is eval.max_sequences now."""
    with pytest.raises(ConfigError, match="renamed eval.max_sequences"):
        load_config("tiny-cpu", ["eval.max_documents=8"])
    assert load_config("tiny-cpu", ["eval.max_sequences=8"]).eval.max_sequences == 8


def test_unknown_field_is_an_error():
    with pytest.raises(ConfigError, match=r"train.lrr: unknown field"):
        load_config("tiny-cpu", ["train.lrr=0.1"])


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["model.hidden_size=100", "model.num_attention_heads=3"], "divisible by num_attention_heads"),
        (["train.launch.nproc_per_node=3", "parallel.tensor_model_parallel_size=2"], "multiple of tensor x pipeline"),
        (["train.global_batch_size=12", "train.micro_batch_size=8"], "multiple of micro_batch_size"),
        (["train.schedule.warmup_iters=500", "train.train_iters=100"], "warmup_iters"),
        (["data.valid_fraction=0.9"], "data.valid_fraction"),
    ],
)
def test_incompatible_settings_fail_before_work(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config("tiny-cpu", overrides)


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError, match="tiny-cpu"):
        load_config("no-such-preset")


def test_stage_hash_tracks_only_its_sections():
    a = load_config("tiny-cpu")
    b = load_config("tiny-cpu", ["train.optimizer.lr=1e-3"])
    assert a.stage_hash("data", "tokenizer") == b.stage_hash("data", "tokenizer")
    assert a.stage_hash("train") != b.stage_hash("train")


def test_roundtrip_through_yaml(tmp_path):
    cfg = load_config("tiny-cpu", ["train.optimizer.lr=1e-3"])
    assert load_config(str(save_config(cfg, tmp_path / "c.yaml"))) == cfg
    assert "train.optimizer.lr" in cfg.flat() and isinstance(PipelineConfig().flat()["model.num_layers"], int)


@pytest.mark.integration  # runs the CLI in a subprocess
def test_cli_rejects_bad_override_with_exit_code_2():
    proc = subprocess.run(
        [sys.executable, "-m", "difflm.flows.cli", "config", "show", "model.num_layers=zero"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "model.num_layers" in proc.stderr


def test_cli_says_overrides_take_no_dashes(capsys):
    import pytest

    from difflm.flows.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["config", "show", "--workdir=/tmp/x"])
    assert exit_.value.code == 2 and "overrides take no dashes: workdir=/tmp/x" in capsys.readouterr().err


def test_model_presets_fill_fields_and_explicit_fields_win():
    cfg = load_config("tiny-cpu", ["model.preset=7b"])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_query_groups) == (32, 4096, 8)
    assert cfg.model.ffn_size == 11008
    cfg = load_config("tiny-cpu", ["model.preset=125m", "model.num_layers=4"])
    assert (cfg.model.num_layers, cfg.model.hidden_size) == (4, 768)
    with pytest.raises(ConfigError, match="model.preset"):
        load_config("tiny-cpu", ["model.preset=13b"])


@pytest.mark.integration  # runs the CLI in a subprocess
def test_cli_reports_bad_input_without_traceback(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "difflm.flows.cli",
            "train",
            "--preset",
            "test-tiny",
            f"workdir={tmp_path}",
            f"data.sources=[{tmp_path / 'missing.jsonl'}]",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.integration  # bash -n on the scripts
def test_cluster_launch_files(tmp_path):
    import yaml as _yaml

    from difflm.models.launch.cluster import k8s_pytorchjob, sbatch_options, slurm_script

    cfg = load_config(
        "tiny-cpu",
        [
            "train.launch.nnodes=4",
            "train.launch.nproc_per_node=8",
            "train.global_batch_size=512",
            "parallel.tensor_model_parallel_size=2",
        ],
    )
    paths = (tmp_path / "config.yaml", tmp_path / "manifest.json", tmp_path / "run dir")
    script = slurm_script(cfg, *paths)
    assert "--partition=gpu" in sbatch_options(cfg, partition="gpu") and "--partition" not in script
    assert "#SBATCH --nodes=4" in script and "#SBATCH --gpus-per-node=8" in script
    assert "--rdzv_endpoint $MASTER_ADDR:$MASTER_PORT" in script and "'" + str(paths[2]) + "'" in script
    (tmp_path / "s.sh").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "s.sh")]).returncode == 0  # valid shell
    job = _yaml.safe_load(k8s_pytorchjob(cfg, *paths, image="img:1"))
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 3
    container = specs["Worker"]["template"]["spec"]["containers"][0]
    assert (
        container["resources"]["limits"]["nvidia.com/gpu"] == 8
        and "difflm.models.megatron.train" in container["command"]
    )
    with pytest.raises(ConfigError, match="nproc_per_node x nnodes"):
        load_config("tiny-cpu", ["train.launch.nnodes=3", "parallel.tensor_model_parallel_size=2"])


@pytest.mark.integration  # runs the CLI in a subprocess
def test_malformed_preset_is_one_line_with_file_line_and_column(tmp_path):
    preset = tmp_path / "my.yaml"
    preset.write_text("train:\n  lr: 1e-3\nmodel: {num_layers: [2, 3}\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(preset))
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{preset}:3:") and "expected" in text, text
    preset.write_text("- train\n- model\n")
    with pytest.raises(ConfigError, match="a preset is a mapping of sections"):
        load_config(str(preset))
    # through the CLI: one line on stderr, exit code 2, no traceback
    proc = subprocess.run(
        [sys.executable, "-m", "difflm.flows.cli", "config", "show", "--preset", str(preset)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("train.lrr=1e-3", "did you mean train.optimizer.lr?"),
        ("diffusion.model_runing_mode=ar", "did you mean diffusion.model_running_mode?"),
        ("modle.num_layers=2", "did you mean model?"),
    ],
)
def test_misspelt_field_suggests_the_right_one(override, suggestion):
    with pytest.raises(ConfigError, match=re.escape(suggestion)):
        load_config("tiny-cpu", [override])


def test_a_shorter_run_says_which_warmup_to_set():
    with pytest.raises(ConfigError, match=r"set train.schedule.warmup_iters too, e.g. train.schedule.warmup_iters=5"):
        load_config("tiny-cpu", ["train.train_iters=50"])
    assert load_config("tiny-cpu", ["train.train_iters=50", "train.schedule.warmup_iters=5"]).train.train_iters == 50


def _alias_bomb(levels: int) -> str:
    """'Billion laughs': each level a list of nine aliases of the one before, 9**levels strings from a few hundred
    bytes (levels=9: 314 bytes, 387 million strings)."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefghi", "bcdefghij"[: levels - 1], strict=False):
        lines.append(f"{name}: &{name} [{','.join([f'*{prev}'] * 9)}]")
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_in_one_short_line(tmp_path):
    # issue 50 item 6b: 314 bytes of aliases made `difflm config show` print 580 MB (the error echoed the value)
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb(7))  # 4.8 million strings: big enough to show the echo, small enough to fail fast
    with pytest.raises(ConfigError) as err:
        load_config(str(bomb))
    line = str(err.value)
    assert "\n" not in line and len(line) < 500 and "alias" in line and str(bomb) in line, line[:500]


def test_an_error_echoes_at_most_a_few_hundred_characters_of_a_value(tmp_path):
    preset = tmp_path / "long.yaml"
    preset.write_text(f"model: {{num_layers: {'x' * 100_000}}}\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(preset))
    assert len(str(err.value)) < 1000 and "model.num_layers" in str(err.value)


@pytest.mark.integration  # the CLI in a process of its own
def test_config_show_refuses_a_314_byte_alias_bomb_in_one_line(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb(9))
    assert len(bomb.read_bytes()) < 400
    proc = subprocess.run(
        [sys.executable, "-m", "difflm.flows.cli", "config", "show", "--preset", str(bomb)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(proc.stderr) < 500 and not proc.stdout
    assert "alias" in proc.stderr
