"""Errors before work: what needs no server fails in one line before the CLI starts a server, a data prep or a
trainer (the unit tier refuses any process start, so a command that got as far as a Prefect server fails here)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from difflm import memory
from difflm.config import load_config
from difflm.flows import cli
from difflm.models.hf.convert import ConversionError
from difflm.models.megatron.safe_pickle import UnsafeCheckpoint, check_common
from difflm.tasks.adapt import adaptation_config


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("difflm: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _nothing_written(workdir: Path) -> None:
    # no Prefect state (the CLI sets it up only once the checks pass), no data prep, no run
    assert not workdir.exists() or not any(workdir.iterdir()), sorted(workdir.rglob("*"))


@pytest.mark.parametrize(
    "argv, says",
    [
        (["adapt", "{missing}"], "pass a Hugging Face model folder"),
        (["adapt", "{missing}", "--preset", "adapt-diffullama"], "no such file or folder"),
        (["convert", "{missing}", "--preset", "tiny-cpu"], "pass a run directory"),
        (["convert", "{missing}", "--flow", "--preset", "tiny-cpu"], "no such"),
        (["eval", "{missing}", "--preset", "tiny-cpu"], "models:/<name>/<version>"),
        (["eval", "{missing}", "--flow", "--preset", "tiny-cpu"], "no such file or folder"),
        (["generate", "{missing}", "--preset", "tiny-cpu"], "pass an export folder"),
        (["eval-latest", "{missing}", "--preset", "tiny-cpu"], "pass <workdir>/runs/<run>"),
        (["run", "data.sources=[{{path: {missing}}}]"], "does not exist"),
        (["prep", "--flow", "data.sources=[{{path: {missing}}}]"], "does not exist"),
    ],
)
def test_a_wrong_path_is_one_line_before_any_server(argv, says, tmp_path, capsys):
    workdir = tmp_path / "work"
    argv = [a.format(missing=tmp_path / "nothere") for a in argv]
    assert cli.main([*argv, f"workdir={workdir}"]) != 0
    assert says in _one_line_error(capsys)
    _nothing_written(workdir)


def test_a_model_too_big_for_memory_is_refused_with_both_numbers_before_data_prep(tmp_path, capsys):
    workdir = tmp_path / "work"
    assert cli.main(["train", "model.hidden_size=1048576", f"workdir={workdir}"]) == 1
    err = _one_line_error(capsys)
    assert "does not fit" in err and "52,780,929,646,592 parameters" in err and "available host memory is" in err, err
    assert "TB for weights, gradients and Adam state" in err and "model.hidden_size=1048576" in err
    _nothing_written(workdir)


def test_the_estimate_counts_a_known_model_exactly():
    """SmolLM2-135M (tied embeddings, 30 layers of 576, GQA 9/3, gated MLP 1536, vocab 49152): 134,515,008."""
    fields = [
        "model.num_layers=30",
        "model.hidden_size=576",
        "model.num_attention_heads=9",
        "model.num_query_groups=3",
        "model.ffn_hidden_size=1536",
        "tokenizer.vocab_size=49152",
    ]
    cfg = load_config("tiny-cpu", fields)
    assert memory.parameter_count(cfg) == 134_515_008
    count, per_device = memory.training_bytes(cfg)
    assert per_device == count * 16  # fp32 weights + fp32 grads + Adam's two moments
    bf16 = memory.training_bytes(load_config("tiny-cpu", [*fields, "train.precision=bf16"]))[1]
    assert bf16 == count * 18  # bf16 weights, fp32 grads, fp32 main weights, Adam
    memory.check_fits(cfg, gpu_bytes=0, host_bytes=3 * 10**9)  # fits: no error
    with pytest.raises(memory.ModelTooBig, match="2.2 GB .* available host memory is 2.0 GB"):
        memory.check_fits(cfg, gpu_bytes=0, host_bytes=2 * 10**9)


def test_a_gpu_holds_its_part_of_a_split_model():
    big = load_config("tiny-cpu", ["model.preset=7b", "tokenizer.vocab_size=32000"])
    with pytest.raises(memory.ModelTooBig, match="one GPU's memory is 80.0 GB"):
        memory.check_fits(big, gpu_bytes=80 * 10**9)
    split = ["model.preset=7b", "parallel.tensor_model_parallel_size=2", "train.launch.nproc_per_node=2"]
    split = load_config("tiny-cpu", split)
    memory.check_fits(split, gpu_bytes=80 * 10**9)
    cluster = load_config("tiny-cpu", ["model.preset=7b", "train.launch.launcher=slurm"])
    memory.check_fits(cluster, gpu_bytes=10**9)  # trains elsewhere: not this machine's memory


@pytest.mark.parametrize("text", ['{"model_type": "llama",', "[1, 2]", "\xff\xfe"])
def test_a_malformed_config_json_is_one_line(text, tmp_path, capsys):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(ConversionError, match="config.json .*restore it from the model's"):
        adaptation_config(str(folder), "adapt-dream", [])
    workdir = tmp_path / "work"
    assert cli.main(["adapt", str(folder), f"workdir={workdir}"]) == 1
    assert "config.json" in _one_line_error(capsys)
    _nothing_written(workdir)


class _Payload:
    def __init__(self, mark: Path):
        self.mark = mark

    def __reduce__(self):
        return (os.system, (f"id > {self.mark}",))


def _checkpoint_with_crafted_common(root: Path, mark: Path) -> Path:
    ck = root / "ckpt"
    ck.mkdir()
    (ck / "metadata.json").write_text('{"sharded_backend": "torch_dist", "common_backend": "torch"}')
    (ck / "common.pt").write_bytes(pickle.dumps({"iteration": 3, "x": _Payload(mark)}, protocol=2))
    return ck


def test_a_crafted_common_pt_is_refused_in_one_line_before_training(tmp_path, capsys):
    mark = tmp_path / "PWNED_common"
    ck = _checkpoint_with_crafted_common(tmp_path, mark)
    with pytest.raises(UnsafeCheckpoint, match=r"common.pt is refused by the weights-only loader \(.*posix.system"):
        check_common(ck)
    workdir = tmp_path / "work"
    assert cli.main(["train", f"train.init_from={ck}", f"workdir={workdir}"]) == 1
    err = _one_line_error(capsys)
    assert "[rank" not in err and "nothing was run" in err
    assert not mark.exists()
    _nothing_written(workdir)
    torch_saved = tmp_path / "real"
    torch_saved.mkdir()
    torch.save({"iteration": 3, "args": {"lr": 1e-3}}, torch_saved / "common.pt")
    check_common(torch_saved)  # what megatron writes passes
