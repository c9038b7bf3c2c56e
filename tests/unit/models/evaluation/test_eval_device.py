"""Where evaluation runs (issue #8): eval.device and eval.dtype resolved when the model is loaded, the scores
of a bf16 evaluation against fp32 ones, and the device and dtype recorded beside the scores (results.json, the
report, MLflow tags). The random-weight exports of the `exports` fixture (tests/conftest.py): no training here."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import torch
from helpers import ROOT, tiny_config
from mlflow.tracking import MlflowClient
from pydantic import ValidationError

from difflm import tracking
from difflm.config import ConfigError, EvalConfig, load_config
from difflm.models.evaluation.record import EvalRecord
from difflm.models.evaluation.report import comparison_table
from difflm.models.evaluation.stages import EvaluationError, eval_device, evaluate_export, resolve_device, sweep_export

# bf16 against fp32 on the same export and noise, as the relative difference of each score (bounds, task NLLs,
# bits per byte): measured at most 2e-5 on these random-weight exports (masked and ar; fp16 less), whose
# near-zero logits bf16 rounds only slightly. The bound leaves 50x room; a trained model's gaps are larger (its
# logits are bounded in tests/unit/models/hf/test_hf_device.py).
BF16_REL = 1e-3
# CUDA bf16 runs other kernels (cuBLAS, flash SDPA) than the CPU: twice the CPU bound, as test_hf_device does.
CUDA_BF16_REL = 2e-3


@pytest.fixture
def no_cuda(monkeypatch):
    """This machine without CUDA, whatever it has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ---- the resolver -----------------------------------------------------------------------------------------
def test_auto_is_the_cpu_in_float32_without_cuda(no_cuda):
    assert resolve_device() == (torch.device("cpu"), torch.float32)
    assert eval_device(EvalConfig()) == (torch.device("cpu"), torch.float32)
    assert eval_device(EvalConfig(dtype="bfloat16")) == (torch.device("cpu"), torch.bfloat16)
    assert eval_device(EvalConfig(device="cpu", dtype="float16")) == (torch.device("cpu"), torch.float16)


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_is_an_error_that_says_what_to_set(no_cuda, device):
    cfg = load_config("test-tiny", [f"eval.device={device}"])  # a GPU machine's config loads anywhere...
    with pytest.raises(
        EvaluationError, match=rf"eval\.device={device}, but .*set eval\.device=auto .* eval\.device=cpu"
    ):
        eval_device(cfg.eval)  # ...and fails where the model would be loaded


def test_the_cli_prints_the_error_without_a_traceback(exports, tmp_path):  # noqa: F811
    """`difflm generate` asked for CUDA where torch sees none (CUDA_VISIBLE_DEVICES empty: on GPU machines too)."""

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "difflm.flows.cli",
            "generate",
            str(exports["difflm-noshift"]),
            "--prompt",
            "The river",
            "--preset",
            "test-tiny",
            f"workdir={tmp_path}",
            "eval.device=cuda",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "eval.device=cuda, but" in run.stderr and "set eval.device=auto" in run.stderr


def test_auto_is_cuda_in_bfloat16_when_cuda_is_there(monkeypatch):
    """Resolved only: nothing is moved, so this runs on a CPU-only torch."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device() == (torch.device("cuda"), torch.bfloat16)
    assert resolve_device("auto", "float32") == (torch.device("cuda"), torch.float32)
    assert resolve_device("cpu") == (torch.device("cpu"), torch.float32)  # auto dtype follows the device


def test_device_form_is_checked_by_the_config_and_dtype_by_the_resolver():
    for good in ("auto", "cpu", "cuda", "cuda:3"):
        assert EvalConfig(device=good).device == good
    for bad in ("gpu", "cuda:x", "cuda:-1", "CPU", "tpu"):
        with pytest.raises(ConfigError, match="eval.device must be auto, cpu, cuda or cuda:<index>"):
            load_config("test-tiny", [f"eval.device={bad}"])
    with pytest.raises(ValidationError, match="eval.device must be"):
        EvalConfig(device="cuda:")  # (on the command line YAML reads `cuda:` as a mapping: not a string)
    with pytest.raises(ConfigError, match="eval.dtype"):
        load_config("test-tiny", ["eval.dtype=fp8"])
    with pytest.raises(EvaluationError, match="model_args dtype must be auto, float32, bfloat16, float16"):
        resolve_device("cpu", "half", setting="model_args ")  # the lm-eval adapter's words for its model_args


# ---- evaluation in bf16 on the CPU ------------------------------------------------------------------------
def _evaluate(exports, tiny_manifest, workdir: Path, *overrides: str) -> EvalRecord:  # noqa: F811
    cfg = tiny_config(workdir, "diffusion.model_running_mode=difflm-noshift", *overrides)
    return evaluate_export(cfg, tiny_manifest, exports["difflm-noshift"], workdir / "eval")


@pytest.fixture(scope="module")
def fp32_results(exports, tiny_manifest, tmp_path_factory) -> EvalRecord:  # noqa: F811
    return _evaluate(exports, tiny_manifest, tmp_path_factory.mktemp("fp32"), "eval.device=cpu", "eval.dtype=auto")


def test_the_untrained_baseline_can_be_left_out(exports, tiny_manifest, tmp_path, fp32_results):  # noqa: F811
    """A study's points skip it (the same baseline for every point of a mode and size); the trained model's
    bound is the same number."""
    res = _evaluate(exports, tiny_manifest, tmp_path, "eval.device=cpu", "eval.untrained_baseline=false")
    assert set(res.bounds) == {"trained"} and set(fp32_results.bounds) == {"trained", "untrained"}
    assert res.trained == fp32_results.trained


def _scores(res: EvalRecord) -> dict[str, float]:
    """Every number evaluation reports that the model's arithmetic moves continuously (not accuracies)."""
    out = {f"bound.{k}": v["nll_per_token"] for k, v in res.bounds.items()}
    out.update({f"{t}.nll": s["nll"] for t, s in res.tasks.items() if "nll" in s})
    out["documents.bits_per_byte"] = res.tasks["documents"]["bits_per_byte"]
    return out


def _assert_close(got: dict, ref: dict, rel: float) -> None:
    assert got.keys() == ref.keys()
    for key in ref:
        assert math.isfinite(got[key]), key
        assert got[key] == pytest.approx(ref[key], rel=rel), key


def test_bf16_evaluation_on_the_cpu_tracks_fp32(exports, tiny_manifest, fp32_results, tmp_path):  # noqa: F811
    bf16 = _evaluate(exports, tiny_manifest, tmp_path, "eval.dtype=bfloat16")  # device auto: the CPU here
    assert (fp32_results.device, fp32_results.dtype) == ("cpu", "float32")
    assert (bf16.device, bf16.dtype, bf16.device_name) == ("cpu", "bfloat16", "cpu")
    assert {"trained", "untrained"} <= bf16.bounds.keys()  # the untrained model is cast too
    _assert_close(_scores(bf16), _scores(fp32_results), BF16_REL)
    assert _scores(bf16) != _scores(fp32_results)  # it did run in bf16
    assert bf16.samples and all(s["tokens"] >= 0 for s in bf16.samples)

    older = EvalRecord(mode="ar", data_hash="d", export="e", bounds={"trained": {}})  # no device recorded
    table = comparison_table({"fp32": fp32_results, "bf16": bf16, "older": older})
    assert "| device / dtype |" in table.splitlines()[0]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()[2:]}
    assert rows["bf16"].endswith("| cpu / bfloat16 |") and rows["fp32"].endswith("| cpu / float32 |")
    assert rows["older"].endswith("| - |")  # results.json written before the device was recorded


def test_mlflow_run_says_what_was_asked_and_what_ran(fp32_results, tmp_path):
    """Params: the config as given (eval.device=auto); tags: what it resolved to."""
    cfg = tiny_config(tmp_path)
    with tracking.pipeline_run(cfg, "eval-device", {"flow": "test"}) as run_id:
        tracking.log_evaluation(fp32_results.to_dict())
    assert run_id and not tracking.DEGRADED
    mlflow.set_tracking_uri(tracking.tracking_uri(cfg))
    run = MlflowClient().get_run(run_id)
    assert run.data.params["eval.device"] == "auto" and run.data.params["eval.dtype"] == "auto"
    assert run.data.tags["eval.device"] == "cpu" and run.data.tags["eval.dtype"] == "float32"
    assert run.data.tags["eval.device_name"] == "cpu"


# ---- CUDA -------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_evaluation_tracks_the_cpu(exports, tiny_manifest, fp32_results, tmp_path):  # noqa: F811
    """eval.device=auto on a GPU machine: CUDA in bf16, the scores those of the CPU in fp32 up to the
    arithmetic (the noise is drawn on the CPU either way)."""
    res = _evaluate(exports, tiny_manifest, tmp_path)
    assert res.device.startswith("cuda") and res.dtype == "bfloat16" and res.device_name != "cpu"
    _assert_close(_scores(res), _scores(fp32_results), CUDA_BF16_REL)

    cfg = tiny_config(tmp_path, "diffusion.model_running_mode=difflm-noshift", "eval.steps_sweep=[1,2]")
    rows = sweep_export(cfg, tiny_manifest, exports["difflm-noshift"], tmp_path / "sweep")
    assert [r["steps"] for r in rows] == [1, 2] and all(r["dtype"] == "bfloat16" for r in rows)
    assert all(r["device"].startswith("cuda") and r["tokens_per_s"] > 0 for r in rows)
