"""A new pipeline stage is a function, one `Stage` row (flows/stages.py) and the typed attribute its result is kept
under (a `Slot` on PipelineRun, or on a subclass for a pipeline of its own): inserted into a pipeline's list, it
runs, is cached by Prefect while its output is on disk, reruns when that output is gone, records its status and
publishes its summary, with no other production change."""

from __future__ import annotations

from pathlib import Path

from helpers import tiny_config

from difflm.flows.pretrain import CONVERT, EVALUATE, PRETRAIN_STAGES
from difflm.flows.stages import PipelineRun, Slot, Stage, run_stages
from difflm.models.hf.export import Export
from difflm.tasks import artifacts


class QuantizedRun(PipelineRun):
    """The pipeline's run with the new stage's result: `run.quantized`."""

    quantized = Slot[str]("quantize")


def quantize(cfg, hf_dir: str, out: str) -> str:
    """The toy stage's function: "quantize the export" into `out` (a marker file is its whole output)."""
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "quantized.json").write_text(f'{{"from": "{hf_dir}"}}')
    return out


def test_a_new_stage_is_one_row(tmp_path, prefect_harness, monkeypatch):
    calls, published = [], []
    monkeypatch.setattr(artifacts, "publish", lambda key, md, title, link=None: published.append((key, md, title)))

    def counted(cfg, hf_dir, out):
        calls.append(out)
        return quantize(cfg, hf_dir, out)

    quantize_row = Stage(
        "quantize",
        counted,  # a plain function: run as a Prefect task named after the row
        slot="quantized",
        output=lambda run: run.export.folder.parent / "hf-int8",  # its place beside the run's export
        done=lambda run, out: (out / "quantized.json").exists(),
        args=lambda run, out, key: (run.cfg, str(run.export.folder), str(out)),
        summary=lambda run, out: f"# Quantized\n`{out.result}`",
        title="quantization",
    )
    rows = list(PRETRAIN_STAGES)
    rows.insert(rows.index(CONVERT) + 1, quantize_row)  # after convert, before evaluate
    assert rows.index(quantize_row) + 1 == rows.index(EVALUATE)

    (tmp_path / "run" / "hf").mkdir(parents=True)
    run = QuantizedRun(tiny_config(tmp_path, "tracking.enabled=false"), None, None, {})
    run.export = Export(tmp_path / "run" / "hf", None)  # what the convert row left
    run_stages(run, [quantize_row])
    out = tmp_path / "run" / "hf-int8"
    assert run.quantized == str(out) and run.stages == {"quantize": "ran"} and len(calls) == 1
    assert published == [("quantize-summary", f"# Quantized\n`{out}`", "quantization")]

    run_stages(run, [quantize_row])  # its output is on disk: Prefect's cache answers
    assert run.stages == {"quantize": "cached"} and len(calls) == 1 and run.quantized == str(out)

    (out / "quantized.json").unlink()  # the output is gone: the stage runs again, whatever the cache holds
    run_stages(run, [quantize_row])
    assert run.stages == {"quantize": "ran"} and len(calls) == 2 and (out / "quantized.json").exists()
