"""The evaluation record end to end on a test-tiny run (tests/fixtures/records_before_typing, relocated: nothing is
trained): `difflm eval` writes every field of the record, with a sweep (AUP) and an AR baseline row; a second `eval`
reuses it and says so, or says why it evaluates again; `eval --reproduce` accepts a rerun of the record and names a
changed setting when one is forced; MLflow holds the record's params, metrics and table row; `difflm compare` writes
its table and picture."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from before_typing import RUN, relocate
from mlflow.tracking import MlflowClient

from difflm import tracking
from difflm.config import load_config
from difflm.flows import cli
from difflm.models.evaluation.record import EvalRecord
from difflm.models.hf.configuration_difflm import DiffLMConfig
from difflm.models.hf.modeling_difflm import DiffLMForMaskedLM

pytestmark = pytest.mark.slow  # one evaluation, its reuse, two reproductions and a comparison: ~40 s idle

EVAL_SETTINGS = ["eval.steps_sweep=[2,4]", "eval.threshold_sweep=[0.9]"]


def ar_export(like: Path, out: Path) -> Path:
    """An untrained AR model with `like`'s shape and tokenizer: a baseline row that runs on the same items."""
    d = json.loads((like / "config.json").read_text())
    d.update(model_running_mode="ar", objective={"mode": "ar"}, bidirectional=False)
    for key in ("architectures", "auto_map", "transformers_version", "model_type", "dtype"):
        d.pop(key, None)
    DiffLMForMaskedLM(DiffLMConfig(**d)).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(like / name, out / name)
    return out


def test_record_reproduce_and_compare(tmp_path, capsys):
    wd = relocate(tmp_path / "wd")
    run = wd / RUN
    baseline = ar_export(run / "hf", tmp_path / "ar")
    out = tmp_path / "eval"
    argv = ["eval", str(run), "--out", str(out), *EVAL_SETTINGS, f"eval.baseline={baseline}"]

    assert cli.main(argv) == 0
    record = EvalRecord.read(out)
    # every field the issue names
    assert {"weights_sha256", "tokenizer_sha256", "checkpoint", "objective", "mask_id", "block_size"} <= set(
        record.model
    )
    assert record.model["weights_sha256"] and record.model["mask_id"] == 1
    for key in ("steps", "block_length", "threshold", "remasking", "confidence_rule", "temperature", "cfg_scale"):
        assert key in record.decoding
    assert {"gen_length", "eos_rule", "seed"} <= set(record.decoding)
    gen = record.tasks["cloze_gen"]
    assert gen["protocol"]["stop_sequences"] and set(gen["protocol"]["filters"]) == {"strict", "flexible"}
    assert {"lm_eval", "config_sha256", "data_sha256", "split", "shots", "scorer"} <= set(gen["protocol"])
    assert all({"prompt", "output", "strict", "flexible", "nfe", "tokens"} <= set(s) for s in gen["samples"])
    for task in ("cloze", "choice", "documents"):
        assert record.tasks[task]["samples"] and record.tasks[task]["protocol"]["data_sha256"]
    eff = record.efficiency
    assert eff["nfe"] > 0 and eff["tpf"] == eff["valid_tokens"] / eff["nfe"]
    assert len(eff["tokens_per_s_batch1_runs"]) >= 5 and eff["ttft_s_batch1"] > 0 and eff["peak_memory_gb"] > 0
    assert eff["timing"] and eff["device"] == "cpu" and eff["batch_size"] == 8
    bound = record.bounds["trained"]
    assert bound["stderr"] > 0 and bound["mc_samples"] == 2 and bound["bits_per_byte"] > 0
    assert [r["setting"] for r in record.sweep] == ["steps 2", "steps 4", "threshold 0.9"]
    assert record.aup["value"] is not None and record.aup["points"] == 3
    assert record.baseline["mode"] == "ar" and record.baseline["items"] == gen["items"]
    assert 0 < record.baseline["tpf"] <= 1.0  # AR: a forward per token, the EOS call not a valid token
    assert record.environment["torch"] and record.environment["date"]
    capsys.readouterr()

    # the same settings again: reused, not recomputed; another setting: recomputed, and the line says which
    assert cli.main(argv) == 0
    assert "reused" in capsys.readouterr().out
    assert EvalRecord.read(out).to_dict() == record.to_dict()

    # a rerun of the record reproduces it: every score within its standard error
    assert cli.main(["eval", "--reproduce", str(out), "--out", str(tmp_path / "again")]) == 0
    said = capsys.readouterr().out
    assert "NOT reproduced" not in said and "reproduced: bound nats/token" in said
    assert "reproduced: nfe" in said and "reproduced: cloze_gen exact_match_flexible" in said
    # a setting changed on purpose is named, and the decoding counters no longer match
    code = cli.main(["eval", "--reproduce", str(out), "--out", str(tmp_path / "changed"), "eval.sampler.steps=2"])
    said = capsys.readouterr().out
    assert "decoding.steps: 4 -> 2" in said
    assert code == 1 and "NOT reproduced: nfe" in said

    # MLflow: the record's decoding as params, its efficiency as metrics, its table row and JSON as artifacts
    cfg = load_config("test-tiny", [f"workdir={wd}"])
    with tracking.pipeline_run(cfg, "record", {"flow": "test"}) as run_id:
        tracking.log_evaluation(record.tracked())
    client = MlflowClient(tracking.tracking_uri(cfg))
    mlrun = client.get_run(run_id)
    assert mlrun.data.params["eval.decoding.steps"] == "4"
    assert mlrun.data.params["eval.model.weights_sha256"] == record.model["weights_sha256"]
    assert mlrun.data.metrics["eval.tpf"] == pytest.approx(eff["tpf"])
    assert mlrun.data.metrics["eval.nfe"] == eff["nfe"] and "eval.aup" in mlrun.data.metrics
    assert mlrun.data.metrics["eval.baseline.tpf"] == pytest.approx(record.baseline["tpf"])
    files = {f.path for f in client.list_artifacts(run_id, "eval")}
    assert {"eval/results.json", "eval/record_row.md"} <= files

    # compare: a point per setting, the AR row marked, a table and a picture, and an MLflow run
    report = tmp_path / "compare"
    assert cli.main(["compare", str(out), str(tmp_path / "changed"), "--out", str(report), f"workdir={wd}"]) == 0
    table = (report / "compare.md").read_text()
    assert "AR baseline (AR)" in table and "threshold 0.9" in table and "tokens/s (batch 1)" in table
    assert (report / "compare.png").stat().st_size > 10_000
    points = json.loads((report / "compare.json").read_text())["points"]
    assert len(points) == 1 + 3 + 1 + 1  # own + sweep + baseline of the first, own of the second
