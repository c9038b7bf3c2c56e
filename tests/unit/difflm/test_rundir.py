"""A run directory's layout (difflm/rundir.py) and the commands that take a SOURCE: they default to what the
source's run recorded (config.yaml, data_manifest.json) and never write over the run's results with results on
other data. The new-user trial: train test-tiny on one's own corpus, then `difflm eval RUN` without repeating
the data overrides."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import manifest_record, tiny_config
from prefect.serializers import JSONSerializer

from difflm.data_prep.pipeline import prepare_data
from difflm.flows.cli import main
from difflm.models.evaluation.stages import evaluate_export
from difflm.models.hf.convert import hf_config, save_export
from difflm.models.hf.export import Export
from difflm.models.hf.modeling_difflm import DiffLMForMaskedLM
from difflm.models.launch.torchrun import TRAIN_SECTIONS, run_dir, write_run_inputs
from difflm.models.megatron import checkpointing
from difflm.rundir import RunDir, TrainResult, Workdir, exported_from, is_export_of, iteration_of, latest_iteration
from difflm.tasks.adapt import ImportedSource
from difflm.tasks.cache import eval_done, mark_eval_done
from difflm.tasks.sources import (
    conversion_source,
    evaluation_source,
    is_other_data,
    recorded_data,
    source_config,
    stage_config,
)

ROOT = Path(__file__).resolve().parents[3]


# ---- the layout, alone -----------------------------------------------------------------------------------


def _fake_run(root: Path, iterations=(4, 8), latest: int | None = 8, data_hash: str = "abc") -> RunDir:
    run = RunDir(root / "runs" / "difflm-noshift-abc-def")
    for it in iterations:
        run.checkpoint(it).mkdir(parents=True)
        (run.checkpoint(it) / "metadata.json").write_text("{}")
    if latest is not None:
        (run.checkpoints / "latest").write_text(str(latest))
    run.config_file.write_text("name: test-tiny\n")
    manifest_record(data_hash).write(run.manifest_file)
    return run


def _fake_export(folder: Path, checkpoint: Path | None) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "difflm_export.json").write_text(json.dumps({"checkpoint": str(checkpoint) if checkpoint else None}))
    return folder


def test_the_paths_of_a_run_directory(tmp_path):
    run = RunDir(tmp_path / "r")
    assert run.config_file == tmp_path / "r" / "config.yaml" and run.manifest_file.name == "data_manifest.json"
    assert run.metrics_file.name == "metrics.jsonl" and run.train_log.name == "train.log"
    assert run.checkpoints == tmp_path / "r" / "checkpoints" and run.hf == tmp_path / "r" / "hf"
    assert run.checkpoint(12) == tmp_path / "r" / "checkpoints" / "iter_0000012"
    assert run.export_dir(run.checkpoint(4)) == tmp_path / "r" / "exports" / "iter_0000004"
    assert [m.name for m in run.markers] == ["preempted.json", "stopped.json"]
    assert run.eval_latest.name == "eval_latest" and iteration_of(run.checkpoint(7)) == 7
    assert iteration_of(tmp_path / "hf") is None


def test_latest_iteration_is_the_newest_complete_checkpoint(tmp_path):
    run = _fake_run(tmp_path)
    assert run.latest_iteration() == 8 and run.is_finished(8) and not run.is_finished(20)
    assert latest_iteration(run.checkpoints) == 8
    (run.checkpoints / "latest").write_text("12")  # names a checkpoint that is not there (pruned, or unfinished)
    assert run.latest_iteration() is None
    assert RunDir(tmp_path / "nothing").latest_iteration() is None


def test_megatron_checkpointing_reads_the_same_layout():
    assert (
        checkpointing.latest_iteration is latest_iteration
        and checkpointing.iter_dir is RunDir.checkpoint.__globals__["iter_dir"]
    )


def test_which_folder_is_the_export_of_which_checkpoint(tmp_path):
    run = _fake_run(tmp_path)
    assert run.export_of(run.checkpoint(8)) is None
    _fake_export(run.export_dir(run.checkpoint(4)), run.checkpoint(4))
    _fake_export(run.hf, run.checkpoint(8))
    assert run.export_of(run.checkpoint(8)) == run.hf and is_export_of(run.hf, run.checkpoint(8))
    assert run.export_of(run.checkpoint(4)) == run.export_dir(run.checkpoint(4))
    assert exported_from(run.hf) == str(run.checkpoint(8)) and exported_from(run.checkpoints) is None
    _fake_export(run.eval_latest / "hf", run.checkpoint(6))
    assert run.export_of(run.checkpoint(6)) == run.eval_latest / "hf"


def test_the_run_a_folder_belongs_to(tmp_path):
    run = _fake_run(tmp_path)
    elsewhere = _fake_export(tmp_path / "downloaded" / "model", run.checkpoint(8))  # e.g. a registered version
    for folder in (run.path, run.checkpoints, run.checkpoint(4), elsewhere):
        assert RunDir.holding(folder) == run, folder
    assert RunDir.holding(_fake_export(tmp_path / "alone", None)) is None
    assert RunDir.holding(tmp_path) is None


def test_results_on_other_data_go_beside_the_runs_own(tmp_path):
    run = _fake_run(tmp_path, data_hash="mine")
    assert run.eval_dir() == run.eval_dir("mine") == run.path / "eval"
    assert run.eval_dir("other") == run.path / "eval-other"


def test_the_layout_is_spelt_in_one_module():
    """No other module spells the run layout's folder names or markers (the conversion direction "hf" is a word
    of the convert command, not a folder)."""
    layout = re.compile(
        r"""["'](checkpoints|difflm_export\.json|data_manifest\.json|preempted\.json|stopped\.json|"""
        r"""eval_latest)["']|/ ["']hf["']"""
    )
    offenders = []
    for folder in ("difflm", "models", "tasks", "flows", "data_prep"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "difflm" / "rundir.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if layout.search(line) and not line.lstrip().startswith("#"):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


# ---- a run trained on the user's own corpus ---------------------------------------------------------------

WORDS = (
    "harbour",
    "lantern",
    "quarry",
    "meadow",
    "copper",
    "violin",
    "orchard",
    "glacier",
    "ferry",
    "saddle",
    "thistle",
    "beacon",
    "marble",
    "canyon",
    "willow",
    "falcon",
)


@pytest.fixture(scope="module")
def own_run(tmp_path_factory) -> RunDir:
    """A test-tiny run trained (here: random weights, written as the pipeline writes them) on a corpus of the
    user's own, with its own BPE tokenizer; its final export in hf/."""
    root = tmp_path_factory.mktemp("own-corpus")
    rng = np.random.default_rng(0)
    corpus = root / "notes.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": f"note {i}. " + " ".join(rng.choice(WORDS, 80))}) + "\n" for i in range(80))
    )
    cfg = tiny_config(
        root / "work",
        f"data.sources=[{corpus}]",
        "tokenizer.vocab_size=300",
        "data.min_chars=0",
        "data.valid_fraction=0.2",
    )
    manifest = prepare_data(cfg)
    run = RunDir(run_dir(cfg, manifest))
    write_run_inputs(cfg, manifest, run)
    final = run.checkpoint(cfg.train.train_iters)
    final.mkdir(parents=True)
    (final / "metadata.json").write_text("{}")
    (run.checkpoints / "latest").write_text(str(cfg.train.train_iters))
    torch.manual_seed(0)
    model = DiffLMForMaskedLM(hf_config(cfg, manifest.tokenizer.to_dict())).eval()
    export = Export(run.hf, str(final), mode=cfg.diffusion.model_running_mode, data_hash=manifest.hash)
    save_export(model, Path(manifest.tokenizer.path), export)
    return run


def test_eval_of_a_run_defaults_to_the_data_it_recorded(own_run):
    for source in (own_run.path, own_run.hf):  # the run, and its export (refused before: "pass the preset")
        plan = evaluation_source(str(source))
        assert plan["hf_dir"] == own_run.hf and plan["run_dir"] == own_run.path
        assert plan["config"].data == own_run.config().data and not plan["other_data"]
        assert plan["manifest"] == own_run.manifest() and plan["manifest"].hash == own_run.data_hash()
        assert plan["out_dir"] == own_run.path / "eval"
        assert Path(plan["config"].workdir) == own_run.path.parent.parent  # the run's MLflow and Prefect state


def test_eval_on_other_data_is_explicit_and_writes_elsewhere(own_run):
    own = evaluation_source(str(own_run.path))
    mine = evaluate_export(own["config"], own["manifest"], own["hf_dir"], own["out_dir"], untrained=False)
    results = own_run.path / "eval" / "results.json"
    assert mine.data_hash == own_run.data_hash() and json.loads(results.read_text())["data_hash"] == own_run.data_hash()
    before = {p: p.read_bytes() for p in (own_run.path / "eval").rglob("*") if p.is_file()}
    assert any("lm_eval_tasks" in str(p) for p in before)

    other = evaluation_source(
        str(own_run.path), overrides=["data.sources=[demo:enwiki]", "data.max_documents=40", "data.min_chars=200"]
    )
    assert other["other_data"] and other["manifest"].hash != own_run.data_hash()
    assert other["out_dir"] == own_run.path / f"eval-{other['manifest'].hash}"
    # read through the model's own tokenizer, not a new one trained on the other data
    assert Path(other["config"].tokenizer.path) == own_run.hf.resolve()
    assert other["manifest"].tokenizer.sha256 == own_run.manifest().tokenizer.sha256
    theirs = evaluate_export(other["config"], other["manifest"], other["hf_dir"], other["out_dir"], untrained=False)
    assert theirs.data_hash == other["manifest"].hash
    assert (other["out_dir"] / "results.json").exists()
    after = {p: p.read_bytes() for p in (own_run.path / "eval").rglob("*") if p.is_file()}
    assert after == before  # the run's own results and lm-eval task files are untouched

    # an evaluation outside the pipeline invalidates the pipeline's key, so `difflm run` computes its own again
    mark_eval_done(own_run.path / "eval", "evaluate-key")
    assert eval_done(own_run.path / "eval", "evaluate-key")
    evaluate_export(own["config"], own["manifest"], own["hf_dir"], own["out_dir"], untrained=False)
    assert not eval_done(own_run.path / "eval", "evaluate-key")


def test_an_explicit_preset_is_other_data_too(own_run):
    cfg, run = source_config(own_run.hf, "test-tiny")
    assert run == own_run and cfg.data.sources[0].path == "demo:enwiki" and is_other_data(cfg, run)
    cfg, _ = source_config(own_run.hf, None, ["eval.max_sequences=2"])  # eval settings: still the run's data
    assert cfg.eval.max_sequences == 2 and not is_other_data(cfg, run)
    cfg, _ = source_config(own_run.hf, None, ["data.valid_fraction=0.3", f"tokenizer.path={own_run.hf}"])
    assert is_other_data(cfg, run) and cfg.tokenizer.path == str(own_run.hf)  # a named tokenizer is kept


def test_a_removed_data_folder_is_prepared_again(own_run, tmp_path):
    cfg = own_run.config()
    assert recorded_data(cfg, own_run) == own_run.manifest() and own_run.data_hash() == own_run.manifest().hash
    data = Path(own_run.manifest().dir)
    moved = tmp_path / "moved"
    shutil.move(str(data), moved)
    try:
        assert recorded_data(cfg, own_run) is None  # evaluation then prepares the same data again
    finally:
        shutil.move(str(moved), data)


def test_convert_and_eval_latest_default_to_the_run_config(own_run):
    found = conversion_source(own_run.path)
    assert found.run == RunDir(own_run.path.resolve()) and found.iteration == 20
    assert stage_config(found.run).data == own_run.config().data


def test_difflm_eval_of_a_run_and_of_its_export_uses_the_recorded_data(own_run, capsys):
    """The trial as a new user typed it: `difflm eval RUN` with no data overrides, then `difflm eval RUN/hf`."""
    for source in (own_run.path, own_run.hf):
        assert main(["eval", str(source), "eval.task_items=4", "eval.mc_samples=2"]) == 0
        assert f"results in {own_run.path / 'eval'}" in capsys.readouterr().out
        results = json.loads((own_run.path / "eval" / "results.json").read_text())
        assert results["data_hash"] == own_run.data_hash() and results["task_settings"]["items"] == 4
    before = (own_run.path / "eval" / "results.json").read_bytes()
    assert (
        main(
            [
                "eval",
                str(own_run.path),
                "data.sources=[demo:enwiki]",
                "data.max_documents=40",
                "data.min_chars=200",
                "eval.task_items=4",
                "eval.mc_samples=2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "not the data its run was trained on" in out and f"{own_run.path}/eval-" in out
    assert (own_run.path / "eval" / "results.json").read_bytes() == before


# ---- the workdir, and the typed results that cross Prefect's result store ------------------------------------


def test_the_workdir_owns_its_folders_and_the_run_name(tmp_path):
    cfg = tiny_config(tmp_path)
    manifest = manifest_record(cfg.stage_hash("data", "tokenizer"))
    work = Workdir.of(cfg)
    run = work.run_for(cfg, manifest)
    name = f"{cfg.diffusion.model_running_mode}-{manifest.hash}-{cfg.stage_hash(*TRAIN_SECTIONS)}"
    assert run == RunDir(tmp_path.resolve() / "runs" / name) and run_dir(cfg, manifest) == run.path
    assert work.data(manifest.hash) == tmp_path.resolve() / "data" / manifest.hash
    assert (work.evals, work.mlartifacts) == (tmp_path.resolve() / "evals", tmp_path.resolve() / "mlartifacts")
    imported = work.import_for(cfg, "ab" * 32)
    assert imported.path.parent == tmp_path.resolve() / "imports" and imported.path.name.startswith("ab" * 8 + "-tp1-")
    assert not imported.is_complete()
    imported.checkpoint.mkdir(parents=True)
    (imported.checkpoint / "metadata.json").write_text("{}")
    assert imported.is_complete() and run.scores == run.path / "eval_latest" / "scores.json"


def test_typed_results_survive_prefects_json_result_store(tmp_path):
    """The pipeline's stages persist results as JSON (difflm.tasks.cache.run_stage); a cache hit reads them back typed,
    and a record stored before the results were typed (a dict, a path) still reads."""
    result = TrainResult(
        RunDir(tmp_path / "runs" / "r"), tmp_path / "runs" / "r" / "checkpoints" / "iter_0000004", False
    )
    imported = ImportedSource(tmp_path / "megatron", {"path": "/t", "tokens": {"mask_token": "<m>"}}, {"sha256": "x"})
    store = JSONSerializer()
    for value in (result, imported):
        assert store.loads(store.dumps(value)) == value
    old = {"run_dir": str(result.run.path), "checkpoint": str(result.checkpoint), "reused": False}
    assert TrainResult.read(store.loads(store.dumps(old))) == result and result.to_dict() == old
    assert ImportedSource.read(str(tmp_path / "megatron")).checkpoint == tmp_path / "megatron"


def test_the_workdir_used_last_is_remembered_in_the_current_directory(tmp_path):
    """One rule for every reader of a run's results: `.difflm-last` names the workdir of the last run."""
    assert Workdir.last(tmp_path) is None
    work = Workdir(tmp_path / ".difflm-test")
    work.path.mkdir()
    assert work.last_run() is None
    work.last_run_file.write_text(json.dumps({"hf_dir": "/x/hf"}))
    pointer = work.remember(tmp_path)
    assert pointer == tmp_path / ".difflm-last" and Workdir.last(tmp_path).path == work.path
    assert Workdir.last(tmp_path).last_run() == {"hf_dir": "/x/hf"}
    assert work.mlflow_store == work.path / "mlflow.db"
    work.path.rename(tmp_path / "gone")
    assert Workdir.last(tmp_path) is None  # a workdir since removed is not "the last one"
