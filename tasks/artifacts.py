"""Prefect artifacts: a markdown summary per stage (what a user checks first in the Prefect UI) and a link to the
MLflow run. The builders are plain functions of the stage outputs (tested without Prefect); `publish` is the one
place that talks to Prefect, and never fails a stage: an artifact is a view, not a result."""

from __future__ import annotations

from urllib.parse import quote

from prefect.artifacts import create_link_artifact, create_markdown_artifact

from difflm.manifest import DataManifest
from difflm.models.evaluation.record import EvalRecord
from difflm.models.hf.export import Export
from difflm.rundir import TrainResult
from difflm.tracking.registry import TRAINING_VIEW

SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 40) -> str:
    """A one-line picture of a curve (resampled to at most `width` points): the shape of the loss at a glance."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return ""
    if len(vals) > width:
        vals = [vals[round(i * (len(vals) - 1) / (width - 1))] for i in range(width)]
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * (len(SPARK) - 1) + 0.5))] for v in vals)


def _table(header: list[str], rows: list[list]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
    ]


def _ran(cached: bool) -> str:
    return "reused from the Prefect cache (same inputs, output present)" if cached else "ran"


def data_markdown(manifest: DataManifest, cached: bool = False) -> str:
    rows = []
    for split, s in manifest.splits.items():
        rows.append([split, "all", f"{s.documents:,}", f"{s.tokens:,}"])
        rows += [[split, src, f"{c['documents']:,}", f"{c['tokens']:,}"] for src, c in s.sources.items()]
    skipped = ", ".join(f"{k} {n:,}" for k, n in manifest.skipped.items() if n) or "nothing"
    return "\n".join(
        [
            f"# Data `{manifest.hash}`",
            "",
            f"Stage {_ran(cached)}. Folder: `{manifest.dir}`; tokenizer vocabulary {manifest.tokenizer.vocab_size:,}."
            + (
                f" Instruction data (chat template `{manifest.instruction.get('template')}`), a loss mask beside each shard."
                if manifest.instruction
                else ""
            ),
            "",
            *_table(["split", "source", "documents", "tokens"], rows),
            "",
            f"Skipped while cleaning: {skipped}.",
        ]
    )


def training_markdown(
    trained: TrainResult, records: list[dict], cached: bool = False, curves_url: str | None = None
) -> str:
    """`curves_url`: where a browser can fetch the run's curves.png (the MLflow server), shown as the figure."""
    loss = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    lines = [
        f"# Training `{trained.run.name}`",
        "",
        f"Stage {_ran(cached)}"
        + (" (the run directory already held the final checkpoint)" if trained.reused and not cached else "")
        + ".",
        f"Final checkpoint: `{trained.checkpoint}`",
        "",
    ]
    if loss:
        lines += [
            f"loss {loss[0][1]:.4f} → {loss[-1][1]:.4f} over {loss[-1][0]} steps",
            "",
            f"`{sparkline([v for _, v in loss])}`",
            "",
        ]
    if curves_url:
        lines += [f"![training curves]({curves_url})", ""]
    if val:
        lines += _table(["step", "val_loss"], [[s, f"{v:.4f}"] for s, v in val[-8:]]) + [""]
    speed = [r for r in records if r.get("tokens_per_s_per_device")]
    if speed:
        last = speed[-1]
        lines.append(
            f"Throughput: {last['tokens_per_s_per_device']:,.0f} tokens/s per device"
            + (f", MFU {last['mfu']:.1%}" if last.get("mfu") else "")
            + "."
        )
    lines.append("Curves: `curves.png` and `metrics.jsonl` in the run directory and the MLflow run.")
    return "\n".join(lines)


def conversion_markdown(export: Export, cached: bool = False) -> str:
    loads = {
        "difflm": "loads with `AutoModel.from_pretrained(..., trust_remote_code=True)`",
        "hf-stock": "loads with `AutoModelForCausalLM.from_pretrained(...)`, no remote code",
    }[export.format]
    lines = [
        "# Hugging Face export",
        "",
        f"Stage {_ran(cached)}.",
        f"- from `{export.checkpoint}`",
        f"- to `{export.folder}` ({loads})",
    ]
    if export.parity is not None:
        lines.append(f"- logits against the megatron model: max relative difference {export.parity:.2e}")
    return "\n".join(lines)


def evaluation_markdown(results: EvalRecord, cached: bool = False) -> str:
    rows = [
        [name, r.get("kind", ""), f"{r['nll_per_token']:.4f}", f"{r['ppl']:.2f}"] for name, r in results.bounds.items()
    ]
    lines = [
        f"# Evaluation `{results.mode}`",
        "",
        f"Stage {_ran(cached)}; on {results.device or '?'} ({results.dtype or '?'}).",
        "",
        *_table(["model", "bound", "nats/token", "perplexity"], rows),
        "",
    ]
    if results.tasks:
        rows = [
            [name, ", ".join(f"{k} {v:.3f}" for k, v in s.items() if isinstance(v, float))]
            for name, s in results.tasks.items()
        ]
        lines += _table(["task", "scores"], rows) + [""]
    for s in results.samples[:2]:
        lines += [f"> **{s['prompt']}** {s['completion']}", ""]
    return "\n".join(lines)


def mlflow_run_url(uri: str | None, experiment_id: str | None, run_id: str | None) -> str | None:
    """The run's page on an MLflow server; None for a local store (no server to link to)."""
    if not (uri and run_id and experiment_id) or not uri.startswith(("http://", "https://")):
        return None
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{TRAINING_VIEW}"


def mlflow_curves_url(uri: str | None, experiment_id: str | None, run_id: str | None) -> str | None:
    """The run in the model-training view with its curves first (loss and val_loss on one chart): the shared
    view `tracking.share_training_view` stored; None without a run or experiment. Any URI: for a local store,
    pass the `mlflow ui` address that will serve it."""
    if not (uri and run_id and experiment_id) or not uri.startswith(("http://", "https://")):
        return None
    query = f"viewStateShareKey={run_id}&compareRunsMode=CHART&{TRAINING_VIEW}"
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs?{query}"


def mlflow_artifact_url(uri: str | None, run_id: str | None, path: str) -> str | None:
    """A file of the run as the MLflow server serves it to its UI; None for a local store."""
    if not (uri and run_id) or not uri.startswith(("http://", "https://")):
        return None
    return f"{uri.rstrip('/')}/get-artifact?path={quote(path)}&run_id={run_id}"


def publish(key: str, markdown: str, description: str, link: str | None = None) -> None:
    """Attach the summary (and the MLflow link) to the current flow run; a failure is printed, not raised."""
    try:
        create_markdown_artifact(key=key, markdown=markdown, description=description)
        if link:
            create_link_artifact(
                key=f"{key}-mlflow", link=link, link_text="MLflow run", description=f"{description}: the MLflow run"
            )
    except Exception as err:  # no flow context or no API: the stage's result matters, its view does not
        print(f"Prefect artifact {key} not created ({type(err).__name__}: {err})", flush=True)
