"""An evaluation in MLflow: its record's scores as metrics, its protocol (decoding, model digests, versions) as params,
its samples as a table, its JSON and table row as artifacts; a sampler sweep's rows. The record is built in
`difflm.models.evaluation` (a floor above): it arrives here as `EvalRecord.tracked()`'s dict."""

from __future__ import annotations

import json
from pathlib import Path

from difflm.tracking.degraded import tolerant


@tolerant
def log_evaluation(results: dict, prefix: str = "eval") -> None:
    """Bounds and task scores as metrics, samples as a table (with their sampler settings), the report; the
    device and dtype that produced them as tags `<prefix>.device`, `.dtype`, `.device_name` (the params hold
    what was asked for, eval.device=auto; the tags what it resolved to)."""
    import mlflow

    mlflow.set_tags({f"{prefix}.{k}": results[k] for k in ("device", "dtype", "device_name") if k in results})
    for name, res in results["bounds"].items():
        mlflow.log_metrics({f"{prefix}.{name}.nll_per_token": res["nll_per_token"], f"{prefix}.{name}.ppl": res["ppl"]})
    for task, scores in results.get("tasks", {}).items():
        mlflow.log_metrics(
            {
                f"{prefix}.{task}.{k}": float(v)
                for k, v in scores.items()
                if isinstance(v, (int, float)) and k not in ("items", "chance")
            }
        )
    _log_protocol(results, prefix)
    mlflow.log_dict(results, f"{prefix}/results.json")
    samples = results.get("samples", [])
    if samples:
        mlflow.log_table(
            {
                "prompt": [s["prompt"] for s in samples],
                "completion": [s["completion"] for s in samples],
                "tokens": [s["tokens"] for s in samples],
                "model_calls": [s["model_calls"] for s in samples],
                "sampler": [json.dumps(s["sampler"]) for s in samples],
            },
            f"{prefix}/samples.json",
        )
    text = "\n\n".join(f"PROMPT: {s['prompt']}\nCOMPLETION: {s['completion']}" for s in samples)
    mlflow.log_text(text or "(no samples)", f"{prefix}/samples.txt")
    if results.get("report") and Path(results["report"]).exists():
        mlflow.log_artifact(results["report"], prefix)


def _log_protocol(results: dict, prefix: str) -> None:
    """The evaluation record's protocol (models/evaluation/protocol.py, efficiency.py): the decoding and the model's
    identity as params, the efficiency, AUP and the AR baseline's row as metrics, the record's table row as text."""
    import mlflow

    params = {f"{prefix}.decoding.{k}": v for k, v in (results.get("decoding") or {}).items()}
    model = results.get("model") or {}
    params.update(
        {f"{prefix}.model.{k}": model[k] for k in ("weights_sha256", "tokenizer_sha256", "checkpoint") if k in model}
    )
    params.update({f"{prefix}.env.{k}": v for k, v in (results.get("environment") or {}).items() if k != "date"})
    if params:
        mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
    metrics = {f"{prefix}.{k}": float(v) for k, v in (results.get("efficiency") or {}).items() if _number(v)}
    if (results.get("aup") or {}).get("value") is not None:
        metrics[f"{prefix}.aup"] = float(results["aup"]["value"])
    metrics.update(
        {f"{prefix}.baseline.{k}": float(v) for k, v in (results.get("baseline") or {}).items() if _number(v)}
    )
    if metrics:
        mlflow.log_metrics(metrics)
    if results.get("table_row"):
        mlflow.log_text(results["table_row"], f"{prefix}/record_row.md")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@tolerant
def log_sweep(rows: list[dict], plot: Path) -> None:
    """Sampler sweep: exact match, TPF, NFE and tokens/s of each setting: `sweep.*` at the steps of a steps row,
    `sweep.threshold.*` at 100 x the threshold of a threshold row; and the plot."""
    import mlflow

    for r in rows:
        kind, _, value = str(r.get("setting", f"steps {r['steps']}")).partition(" ")
        prefix, step = ("sweep", int(r["steps"])) if kind == "steps" else ("sweep.threshold", round(100 * float(value)))
        mlflow.log_metrics(
            {f"{prefix}.{k}": float(r[k]) for k in ("accuracy", "tpf", "nfe", "tokens_per_s") if r.get(k) is not None},
            step=step,
        )
    if rows and plot.exists():
        mlflow.log_artifact(str(plot), "eval")
