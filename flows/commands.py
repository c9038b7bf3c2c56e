"""What each `difflm` verb does, given its validated config and its options as keywords, and what it prints.

`flows/cli.py` parses the command line and calls one function here per verb; each is a plain function, callable
without argparse. Each imports the stages it runs inside itself, not here: `difflm --help` and `difflm config`
then load no framework, a command loads only what it runs (torch, megatron, Prefect and MLflow take seconds to
import), and Prefect is imported only after the CLI has pointed PREFECT_HOME at the workdir (it reads its
settings when imported).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from difflm.config import CONFIG_DIR, PipelineConfig, study_spec
from difflm.errors import UserError
from difflm.rundir import Workdir

LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store (the line `run` prints)
SUMMARY_KEYS = (
    "data_dir",
    "run_dir",
    "hf_dir",
    "report",
    "mlflow_uri",
    "mlflow_run_id",
    "mlflow_run_url",
    "mlflow_curves_url",
    "registered_model",
    "version",
    "registered_by",
    "promotion",
)
SERVE_GRACE_SECONDS = 10.0


def _fields(summary: dict, keys: tuple[str, ...]) -> list[str]:
    return [f"{key:>16}: {summary[key]}" for key in keys if summary.get(key) is not None]


def run(cfg: PipelineConfig) -> int:
    """The flow pretrain-difflm end to end; prints its summary and keeps it in <workdir>/last_run.json."""
    from difflm.data_prep.pipeline import preflight
    from difflm.flows.pretrain import pretrain_difflm
    from difflm.models.evaluation.likelihood import KIND_LABELS
    from difflm.tasks.artifacts import mlflow_curves_url

    preflight(cfg)  # bad paths fail here, before a Prefect server starts
    summary = pretrain_difflm(config=cfg)
    b = summary["validation"]
    t, u = b["trained"], b.get("untrained")  # no baseline with eval.untrained_baseline=false
    lines = [
        "\n=== pretrain-difflm done ===",
        f"validation {KIND_LABELS[t['kind']]}: trained {t['ppl']:.1f}"
        + (
            f"  untrained {u['ppl']:.1f}  ({t['nll_per_token']:.3f} vs {u['nll_per_token']:.3f} nats/token)"
            if u
            else ""
        )
        + ("" if u else f"  ({t['nll_per_token']:.3f} nats/token)"),
    ]
    for name, scores in summary.get("tasks", {}).items():
        shown = ", ".join(f"{k} {v:.3f}" for k, v in scores.items() if isinstance(v, float) and k != "chance")
        lines.append(f"task {name}: {shown}  ({scores['items']} items)")
    lines += [f"sample: {s['prompt']!r} -> {s['completion'][:160]!r}" for s in summary["samples"]]
    if summary.get("stages"):  # what this execution computed, and what the Prefect cache let it skip
        lines.append("stages: " + ", ".join(f"{k} {v}" for k, v in summary["stages"].items()))
    lines += _fields(summary, SUMMARY_KEYS)
    if summary.get("mlflow_uri") and not summary.get("mlflow_run_url"):  # a local store: no server to link to yet
        link = mlflow_curves_url(LOCAL_UI, summary.get("mlflow_experiment_id"), summary["mlflow_run_id"])
        lines.append(
            f"MLflow UI: {Path(sys.executable).parent / 'mlflow'} ui --backend-store-uri {summary['mlflow_uri']} "
            f"--host 127.0.0.1 --port 5000\n     then open: {link}"
        )
    lines.append(remembered(cfg))
    print("\n".join(lines))
    Workdir.of(cfg).last_run_file.write_text(json.dumps(summary, indent=2))
    return 0


def study(cfg: PipelineConfig, spec: str, preset: str | None, overrides: list[str]) -> int:
    """The flow study (`cfg`: its first point's); prints its table, the crossover per budget and its files."""
    from difflm.data_prep.pipeline import preflight
    from difflm.flows.study import study as study_flow

    preflight(cfg)  # bad data paths fail here, before a Prefect server starts (every point reads the same data)
    summary = study_flow(spec=spec, preset=preset, overrides=overrides)
    print(f"\n=== study {summary['name']} done ===")
    print(Path(summary["table_md"]).read_text())
    print(f"{'table':>8}: {summary['table_csv']}\n{'plot':>8}: {summary['plot']}\n{'folder':>8}: {summary['out_dir']}")
    if summary.get("mlflow_run_id"):
        print(f"{'MLflow':>8}: parent run {summary['mlflow_run_id']} (a nested run per point)")
    return 0


def study_plan(spec: str, preset: str | None, overrides: list[str], device: str, mfu: float) -> int:
    """`difflm study SPEC --plan`: the study's cost, point by point, and the points its run would refuse, without
    training (the data is prepared first if missing: the steps are those of each budget's whole documents)."""
    from difflm.tasks.study_plan import count_tokens, device_peak, plan, plan_table, short_of_warmup

    if not 0 < mfu <= 1:
        raise UserError(f"--mfu {mfu:g} is a share of the device's peak: give one in (0, 1], e.g. 0.4")
    device_peak(device)  # an unknown device is one line before any data is prepared
    the_study = study_spec(spec, preset, overrides)
    points = the_study.points()
    counts = count_tokens(points)
    rows = plan(points, device, mfu, counts)
    print(plan_table(rows, device, mfu, counts))
    for label in short_of_warmup(points, counts):
        print(
            f"warning: {label}: its nominal steps are within its warm-up: its run fails unless whole documents add "
            "the steps it lacks; prepare the data for the verdict, or lower train.schedule.warmup_iters"
        )
    if counts.refused:
        first, line = next(iter(counts.refused.items()))
        raise UserError(
            f"study {the_study.name}: {len(counts.refused)} of {len(points)} points would fail "
            f"({', '.join(counts.refused)}); {first}: {line}"
        )
    return 0


def remembered(cfg: PipelineConfig) -> str:
    """Make the config's workdir the one used last (`Workdir.remember`); the summary line that says so."""
    workdir = Workdir.of(cfg)
    pointer = workdir.remember()
    return (
        f"{'workdir':>16}: {workdir.path}  (named in {pointer}: `make mlflow-ui`, models:/ sources and the docs' "
        "snippets read this one)"
    )


def config(cfg: PipelineConfig, action: str) -> int:
    """show: the resolved config as YAML; presets: the preset files with their first comment; schema: JSON schema."""
    if action == "presets":
        for p in sorted(CONFIG_DIR.glob("*.yaml")):
            first = next((ln.lstrip("# ").strip() for ln in p.read_text().splitlines() if ln.startswith("#")), "")
            print(f"{p.stem:<12} {first}")
    elif action == "schema":
        print(json.dumps(PipelineConfig.model_json_schema(), indent=2))
    else:
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def prep(cfg: PipelineConfig, flow: bool) -> int:
    """Data prep, plain or as the flow data-prep; prints the manifest's counts."""
    from difflm.data_prep.pipeline import SubmittedToCluster, prepare_data

    try:
        if flow:  # Prefect is imported for --flow only
            from difflm.flows.data_prep import data_prep

            m = data_prep(config=cfg)
        else:
            m = prepare_data(cfg)
    except SubmittedToCluster as note:  # prep's job is done once the Slurm job is queued
        print(f"difflm: {note}")
        return 0
    lines = [f"data: {m.dir}"]
    for split, s in m.splits.items():
        per = ", ".join(f"{k} {v['documents']} docs/{v['tokens']:,} tok" for k, v in s.sources.items())
        lines.append(f"  {split:>5}: {s.documents:>7} documents {s.tokens:>12,} tokens  ({per})")
    if m.budget:
        b = m.budget
        lines.append(
            f"  budget: train is {b['tokens']:,} unique tokens ({b['documents']} documents) of the split's "
            f"{b['split_tokens']:,} (data.unique_tokens={b['unique_tokens']}, data.subset_seed={b['subset_seed']})"
        )
    if m.skipped:
        lines.append("  skipped/dropped: " + ", ".join(f"{k}={v}" for k, v in m.skipped.items()))
    lines.append(f"  tokenizer: vocab {m.tokenizer.vocab_size}, sha256 {m.tokenizer.sha256[:12]}")
    lines.append(f"  train data path: {m.split('train').data_path[:200]}")
    print("\n".join(lines))
    return 0


def verify(cfg: PipelineConfig) -> int:
    """Re-read every shard of the config's finished data prep against its manifest."""
    from difflm.data_prep.pipeline import MANIFEST, DataPrepError, data_dir
    from difflm.data_prep.verify import verify as verify_manifest
    from difflm.manifest import DataManifest

    path = data_dir(cfg) / MANIFEST
    if not path.exists():
        raise DataPrepError(f"no finished data prep for this config at {path.parent}; run `difflm prep` first")
    report = verify_manifest(DataManifest.read(path))
    print(f"ok: {report['shards']} shards, {report['documents']} documents, {report['tokens']:,} tokens verified")
    return 0


def train(cfg: PipelineConfig) -> int:
    """Data prep (reused), then training with train.launch.launcher; prints the launcher's result as JSON."""
    from difflm.data_prep.pipeline import prepare_data, unique_tokens
    from difflm.models.launch.cluster import submit_kubernetes, submit_slurm
    from difflm.models.launch.torchrun import launch_training

    launch = {"slurm": submit_slurm, "kubernetes": submit_kubernetes}.get(cfg.train.launch.launcher, launch_training)
    manifest = prepare_data(cfg)
    print(json.dumps(launch(cfg.with_unique_tokens(unique_tokens(manifest)), manifest).to_dict(), indent=2))
    return 0


def launch(cfg: PipelineConfig, target: str) -> int:
    """Write the Slurm script or Kubernetes PyTorchJob of this config; print how to submit it."""
    from difflm.data_prep.pipeline import prepare_data, unique_tokens
    from difflm.models.launch.cluster import mount_problem, sbatch_command, write_launch_file
    from difflm.models.launch.torchrun import run_dir

    kind = "kubernetes" if target in ("k8s", "kubernetes") else "slurm"
    manifest = prepare_data(cfg)
    cfg = cfg.with_unique_tokens(unique_tokens(manifest))  # a length in epochs: its steps
    rdir = run_dir(cfg, manifest)
    out = write_launch_file(cfg, manifest, kind)
    # time, partition and sbatch_args are sbatch's arguments, not lines of the script
    hint = shlex.join(sbatch_command(cfg, out)) if kind == "slurm" else f"kubectl apply -f {out}"
    print(f"{target} launch file: {out}\nsubmit: {hint}\nrun directory (checkpoints, metrics): {rdir}")
    if kind == "kubernetes" and mount_problem(cfg, rdir):
        print(f"difflm: warning: {mount_problem(cfg, rdir)}", file=sys.stderr)
    return 0


def convert(cfg: PipelineConfig, source: str, out: str | None, flow: bool, fmt: str = "difflm") -> int:
    """One conversion, either direction (from the SOURCE), plain or as the flow convert-checkpoint; `fmt`: the
    export's layout (difflm, or an engine's: llada, dream, gguf)."""
    from difflm.tasks.conversion import convert_source
    from difflm.tasks.sources import conversion_source

    found = conversion_source(source)
    if flow:  # Prefect is imported for --flow only
        from difflm.flows.convert import convert_checkpoint

        info = convert_checkpoint(source=source, out_dir=out, config=cfg, format=fmt)
    else:
        info = convert_source(cfg, found, out, fmt)
    if info["to"] == "megatron":
        use = info.get("use") or [f"train.init_from={info['out_dir']}"]
        print(f"megatron checkpoint: {info['out_dir']}\nstart training from it with: {shlex.join(use)}")
        if info.get("parity"):
            print(parity_line(info["parity"]))
    else:
        print(
            f"Hugging Face export: {info['out_dir']}"
            + (" (reused)" if info["reused"] else "")
            + (f"\n  from iteration {info['iteration']} of {info['run_dir']}" if info["run_dir"] else "")
        )
        if info.get("export"):
            print(engine_lines(info["export"], info["out_dir"]))
    return 0


def engine_lines(marker: dict, out_dir: str) -> str:
    """What an engine layout's export recorded, as `difflm convert --format` prints it."""
    lines = [
        f"  layout: {marker['layout']} ({marker['format']}); its logits against megatron's: max |difference| / "
        f"max |logit| = {marker['parity']:.2e} on {' x '.join(map(str, marker['parity_tokens']))} tokens"
    ]
    if marker.get("gguf"):
        g = marker["gguf"]
        lines.append(
            f"  GGUF: {Path(out_dir) / g['file']} (llama.cpp architecture {g['architecture']}, pre-tokenizer "
            f"{g['pre_tokenizer']}; {g['tensors']} tensors read back equal)"
        )
    return "\n".join(lines)


def parity_line(parity: dict) -> str:
    """The import's logit check, as `difflm convert HF_DIR` prints it."""
    tokens = " x ".join(map(str, parity["tokens"]))
    return (
        f"parity: max |logit difference| / max |logit| = {parity['rel_max_logit_diff']:.2e} against the source "
        f"model on {tokens} tokens (tolerance {parity['tolerance']:.0e})"
    )


def adapt(cfg: PipelineConfig, source: str, preset: str, overrides: list[str]) -> int:
    """The flow adapt-difflm; prints the comparison and keeps the summary in <workdir>/last_adapt.json."""
    from difflm.flows.adapt import adapt_difflm

    summary = adapt_difflm(source=source, preset=preset, overrides=overrides)
    stages = ", ".join(f"{k} {v}" for k, v in summary["stages"].items())
    keys = ("checkpoint", "source_hf_dir", "run_dir", "hf_dir", "mlflow_run_id")
    print(
        "\n".join(
            [
                "\n=== adapt-difflm done ===\n" + summary["comparison"],
                f"stages: {stages}",
                *_fields(summary, keys),
                remembered(cfg),
            ]
        )
    )
    Path(cfg.workdir, "last_adapt.json").write_text(json.dumps(summary, indent=2))
    return 0


def serve(
    cfg: PipelineConfig,
    served: str,
    name: str,
    cron: str | None,
    interval: float | None,
    run_dir: str | None,
    max_sequences: int,
    preset: str | None,
    default_preset: str,
    overrides: list[str],
    source: str | None = None,
) -> int:
    """Serve a flow as a deployment of this process, one flow run at a time: pretrain-difflm (the config),
    adapt-difflm (a source) or evaluate-latest on a run."""
    from prefect.deployments.runner import EntrypointType

    # flow runs load the flow by module (difflm.flows.pretrain), not by file: a file puts flows/ first on sys.path,
    # where flows/data_prep.py would shadow the data_prep package
    params: dict[str, Any]  # the flow's parameters (each flow its own)
    schedule: dict[str, Any] = {"cron": cron} if cron else {"interval": interval} if interval else {}
    schedule["entrypoint_type"] = EntrypointType.MODULE_PATH
    if served == "pretrain-difflm":
        from difflm.flows.pretrain import pretrain_difflm

        flow, params = pretrain_difflm, {"preset": preset or default_preset, "overrides": overrides}
    elif served == "adapt-difflm":
        from difflm.flows.adapt import adapt_difflm

        if not source:
            raise UserError("difflm serve adapt-difflm needs --source <HF folder or smollm2> (the model to adapt)")
        flow, params = adapt_difflm, {"source": source, "preset": preset or "adapt-dream", "overrides": overrides}
    else:
        from difflm.flows.evaluate_latest import evaluate_latest
        from difflm.tasks.sources import training_run_dir

        if not run_dir:
            raise UserError(
                "difflm serve evaluate-latest needs --run-dir <workdir>/runs/<run> (the run to score while it trains)"
            )
        schedule = schedule if len(schedule) > 1 else {**schedule, "interval": 600}
        flow, run = evaluate_latest, training_run_dir(run_dir)
        params = {"run_dir": str(run.path), "max_sequences": max_sequences, "overrides": overrides}
        if preset:  # else the run's own config.yaml
            params["preset"] = preset
    every = f" every {interval:g} s" if interval and not cron else f" on cron '{cron}'" if cron else ""
    where = f" on {params['run_dir']}" if "run_dir" in params else ""
    print(f"serving {served}/{name}{where}{every}; {LATE_RUNS[cfg.pipeline.late_runs]}", flush=True)
    with _stops_on_ctrl_c() as interrupted:
        try:
            flow.serve(name=name, parameters=params, global_limit=one_at_a_time(cfg), **schedule)
        except KeyboardInterrupt:  # the runner let the Ctrl-C through (it takes it at other moments): the same stop
            interrupted.set()
    if interrupted.is_set():  # an interrupt whoever handled it: 130 and this line (not the pipeline's "rerun")
        print("difflm: serve stopped on Ctrl-C", file=sys.stderr, flush=True)
        return 130
    return 0


# what `serve` says a run that comes while the deployment's last one still runs does (pipeline.late_runs)
LATE_RUNS = {
    "queue": "one run at a time: a run that comes while one runs waits for it (pipeline.late_runs=queue)",
    "cancel": "one run at a time: a run that comes while one runs is cancelled (pipeline.late_runs=cancel)",
}


def one_at_a_time(cfg: PipelineConfig):
    """Prefect's deployment concurrency limit of one: the server holds a late run in AwaitingConcurrencySlot
    until the running one ends (queue), or cancels it (cancel). A schedule that fires while the last run still
    trains never starts a second pipeline on the same outputs."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

    strategy = {"queue": ConcurrencyLimitStrategy.ENQUEUE, "cancel": ConcurrencyLimitStrategy.CANCEL_NEW}
    return ConcurrencyLimitConfig(limit=1, collision_strategy=strategy[cfg.pipeline.late_runs])


@contextmanager
def _stops_on_ctrl_c() -> Iterator[threading.Event]:
    """Ctrl-C stops `serve` within SERVE_GRACE_SECONDS. Prefect's runner shuts down through the API; when the
    server stopped first, it retried for over a minute and ended in a traceback (tried as a new user would).
    A clean shutdown still gets the grace period; after it, one line and exit 130. Yields an event set on the
    Ctrl-C: when Prefect's runner takes the KeyboardInterrupt and returns within the grace period (it did once
    on a loaded machine, and `serve` then exited 0), the caller still exits 130 with its line."""
    from prefect.settings import PREFECT_API_URL

    def give_up() -> None:
        print(
            f"difflm: serve stopped without deregistering: the Prefect API at {PREFECT_API_URL.value()} did not "
            f"answer within {SERVE_GRACE_SECONDS:g} s (start the server and serve again)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(130)

    interrupted = threading.Event()
    timers: list[threading.Timer] = []

    def on_interrupt(signum, frame) -> None:
        interrupted.set()
        timer = threading.Timer(SERVE_GRACE_SECONDS, give_up)
        timer.daemon = True
        timer.start()
        timers.append(timer)
        signal.signal(signal.SIGINT, lambda *_: give_up())  # a second Ctrl-C: now
        signal.default_int_handler(signum, frame)

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)
        for timer in timers:  # shut down within the grace period: no "did not answer" line after it
            timer.cancel()
