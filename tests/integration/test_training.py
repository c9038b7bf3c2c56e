"""Training under torchrun (gloo, CPU): checkpoints, resume equal to an uninterrupted run, failures."""

import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import TRAINED, tiny_config

from difflm.models.diffusion.modes import objective_class
from difflm.models.evaluation.stages import convert_checkpoint, evaluate_export
from difflm.models.hf.convert import ConversionError, import_hf
from difflm.models.launch.torchrun import TrainingError, launch_training, read_metrics, run_dir
from difflm.models.megatron import checkpointing


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        [],
        ["train.launch.nproc_per_node=2", "train.micro_batch_size=2", "parallel.use_distributed_optimizer=true"],
        ["model.dropout=0.1"],
    ],
    ids=["single", "dp2-distopt", "dropout"],
)
def test_resume_reproduces_uninterrupted_run(session_dir, tiny_manifest, layout):
    cfg = tiny_config(
        session_dir / f"resume{len(layout)}-{len(str(layout))}",
        "train.train_iters=12",
        "checkpoint.save_interval=6",
        "train.log_interval=3",
        "train.eval_interval=6",
        "checkpoint.keep_last=5",
        *layout,
    )
    info = launch_training(cfg, tiny_manifest, echo=lambda _: None)
    rdir = run_dir(cfg, tiny_manifest)
    full = {r["step"]: r for r in read_metrics(rdir) if "loss" in r}
    assert sorted(p.name for p in (rdir / "checkpoints").glob("iter_*")) == ["iter_0000006", "iter_0000012"]
    assert (rdir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not info.reused

    # a finished run is reused, not retrained
    assert launch_training(cfg, tiny_manifest, echo=lambda _: None).reused

    # simulate an interruption after iteration 6: drop the last checkpoint and metrics after it
    shutil.rmtree(rdir / "checkpoints" / "iter_0000012")
    (rdir / "checkpoints" / "latest").write_text("6")
    (rdir / "metrics.jsonl").write_text("")
    info = launch_training(cfg, tiny_manifest, echo=lambda _: None)
    resumed = {r["step"]: r for r in read_metrics(rdir) if "loss" in r}
    assert min(resumed) == 9  # it restarted after iteration 6, not from scratch
    for step in (9, 12):
        assert resumed[step]["loss"] == pytest.approx(full[step]["loss"], rel=1e-5, abs=1e-6)
    assert checkpointing.latest_iteration(rdir / "checkpoints") == 12


@pytest.mark.slow
def test_failed_training_reports_the_log(session_dir, tiny_manifest):
    train = replace(tiny_manifest.split("train"), prefixes=("/nonexistent/shard",))
    broken = tiny_manifest.replace(splits={**tiny_manifest.splits, "train": train})
    cfg = tiny_config(session_dir / "broken", "train.train_iters=3", "train.schedule.warmup_iters=1")
    with pytest.raises(TrainingError, match="training failed .* full log"):
        launch_training(cfg, broken, echo=lambda _: None)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, extra",
    [
        ("difflm-noshift", ["diffusion.varilen_prob=0.5", "diffusion.time_embedding=true"]),
        ("difflm-noshift-uniform", ["diffusion.time_embedding=true"]),
        ("difflm-shift", []),
        ("ar", "ar"),  # the shared trained runs (conftest `trained`)
        ("difflm-block", "block"),  # (block_size 8, varilen 0.5)
    ],
)
def test_each_mode_trains_exports_and_samples(session_dir, tiny_manifest, trained, mode, extra):
    if isinstance(extra, str):
        shared = trained(extra)
        cfg, info = shared.cfg, shared.info
    else:  # the canonical short run (helpers.TRAINED) with this mode's own settings
        cfg = tiny_config(session_dir / "modes", *TRAINED, f"diffusion.model_running_mode={mode}", *extra)
        info = launch_training(cfg, tiny_manifest, echo=lambda _: None)
    assert cfg.diffusion.model_running_mode == mode
    vals = [r["val_loss"] for r in read_metrics(info.run.path) if "val_loss" in r]
    assert len(vals) == 3 and vals[-1] < vals[0], vals  # steps 0, 8 and 16
    # a person can follow a long run: each interval's line says how long the rest will take
    assert re.search(r"\[train\] iter +8/16 .* ETA \d+[smh]", (info.run.path / "train.log").read_text())
    hf_dir = convert_checkpoint(cfg, tiny_manifest, info).folder
    lines: list[str] = []
    results = evaluate_export(cfg, tiny_manifest, hf_dir, echo=lines.append)
    # minutes on 2 cores are not silent: a line per part, with the time so far (tried as a new user would)
    assert [line.split(":")[0] for line in lines[:1]] == ["[eval] bound of the trained model"], lines
    assert any(line.startswith("[eval] tasks: cloze") for line in lines) and lines[-1].startswith("[eval] done")
    b = results.bounds
    assert b["trained"]["nll_per_token"] < b["untrained"]["nll_per_token"]
    assert b["trained"]["kind"] == ("exact" if mode == "ar" else "elbo")
    sample = results.samples[0]
    assert sample["sampler"]["mode"] == mode and sample["sampler"]["steps"] == cfg.eval.sampler.steps
    if objective_class(mode).two_stream:  # the block decoder records its own settings
        assert sample["sampler"]["block_size"] == 8 and sample["sampler"]["kv_cache"]
    cloze = results.tasks["cloze"]
    assert cloze["items"] > 0
    if objective_class(mode).has_greedy:
        assert 0.0 <= cloze["acc"] <= 1.0
    else:  # uniform diffusion has no greedy decision to score: n/a, not 0.000
        assert cloze["acc"] is None
    assert results.tasks["documents"]["bits_per_byte"] > 0
    report = Path(results.report).read_text()  # every mode trained on this data, side by side
    assert f"| {mode} |" in report and info.run.path.name in report


@pytest.mark.slow
def test_hf_import_roundtrip_and_init_from(session_dir, tiny_manifest, trained, tmp_path):
    """megatron -> HF -> megatron gives the same model: a run initialised from the imported weights
    starts at exactly the validation loss the source run (the shared masked run) ended with."""
    shared = trained("masked")
    cfg, info = shared.cfg, shared.info
    source_final = [r["val_loss"] for r in read_metrics(info.run.path) if "val_loss" in r][-1]
    hf_dir = convert_checkpoint(cfg, tiny_manifest, info).folder
    ckpt = import_hf(cfg, hf_dir, tmp_path / "imported", tiny_manifest.tokenizer.to_dict())

    follow = tiny_config(
        session_dir / "import",
        "train.train_iters=3",
        "train.schedule.warmup_iters=1",
        "checkpoint.save_interval=3",
        f"train.init_from={ckpt}",
        "parallel.tensor_model_parallel_size=2",
        "train.launch.nproc_per_node=2",
    )
    info2 = launch_training(follow, tiny_manifest, echo=lambda _: None)
    start_val = [r["val_loss"] for r in read_metrics(info2.run.path) if r["step"] == 0][0]
    assert start_val == pytest.approx(source_final, rel=1e-5)  # resharded to TP=2 on load

    wrong = tiny_config(session_dir / "import", "model.hidden_size=64")
    with pytest.raises(ConversionError, match="hidden_size: checkpoint 32 vs config 64"):
        import_hf(wrong, hf_dir, tmp_path / "nope", tiny_manifest.tokenizer.to_dict())


@pytest.mark.slow
def test_an_ar_checkpoint_adapts_to_block_diffusion(session_dir, tiny_manifest, trained):
    """AR -> block diffusion (SDAR / Megatron-Bridge): the block run starts from the AR run's weights, and its
    first validation bound is already below a block run from scratch (the AR model knows the data)."""
    common = ["train.eval_interval=10", "checkpoint.save_interval=10", "train.schedule.warmup_iters=1"]
    ckpt = trained("ar").info.checkpoint  # the shared AR run's last checkpoint
    block = [
        "diffusion.model_running_mode=difflm-block",
        "diffusion.clean_attention=token_causal",
        "diffusion.ar_loss_weight=1.0",
        "train.train_iters=10",
        *common,
    ]
    starts = {}
    for name, extra in (("scratch", []), ("adapted", [f"train.init_from={ckpt}"])):
        cfg = tiny_config(session_dir / "adapt", *block, *extra)
        run = launch_training(cfg, tiny_manifest, echo=lambda _: None)
        starts[name] = [r["val_loss"] for r in read_metrics(run.run.path) if r["step"] == 0][0]
    assert starts["adapted"] < starts["scratch"], starts
