"""`difflm`: the command line of the pipeline, on the top floor (it dispatches to flows and stages).

One verb per job, each a row of COMMANDS (name, help, arguments, handler); every handler turns argparse's namespace
into one call of `flows/commands.py`. Every command takes `--preset` (a name in configs/ or a YAML path) and
`section.field=value` overrides, with one rule for the default (`preset_default`): a command on an existing run
takes the config.yaml that run recorded, any other command tiny-cpu. The configuration is validated before any
work starts; errors the user can fix (`difflm.errors.UserError`) print one line, no traceback. What each verb does
in detail: docs/cli.md.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from difflm import live_runs, set_offline_env
from difflm.config import PipelineConfig, load_config, study_spec, validate
from difflm.errors import ConfigWarning, UserError, disk_full, is_disk_full
from difflm.flows import commands
from difflm.flows.dead_runs import mark_dead_runs
from difflm.flows.prechecks import check_arguments, check_before_work
from difflm.flows.prefect_api import prefect_api
from difflm.outputs import private_umask
from difflm.reaper import reaped
from difflm.rundir import RunDir, Workdir

# Stages, flows and models are imported inside flows/commands.py's functions, `_run_of_*` and `resolve_config`
# (difflm.tasks.sources): `difflm --help` then loads argparse and the config only (well under a second), and a
# command loads only what it runs (torch, megatron, Prefect and MLflow take seconds to import).

DEFAULT_PRESET = "tiny-cpu"
SERVED = ["pretrain-difflm", "adapt-difflm", "evaluate-latest"]  # what `difflm serve` serves
# besides every command that runs a flow (a Prefect server), these start processes that must not outlive them
# (torchrun and its ranks, data-prep workers, served flow runs): they run under difflm.reaper
STARTS_PROCESSES = {"prep", "train", "adapt", "serve"}
DOCS = "docs/cli.md"  # each verb's page: what it does, in detail, with examples

EPILOG = f"""examples:
  difflm run                                   # the demo: tiny-cpu preset, every stage
  difflm run --preset configs/my.yaml diffusion.model_running_mode=ar
  difflm config show train.optimizer.lr=1e-3             # print the resolved configuration
  difflm eval .difflm/runs/<run> .difflm/runs/<ar run>   # tasks + bounds, side by side
  difflm convert .difflm/runs/<run>             # newest checkpoint -> <run>/exports/iter_XXXXXXX (HF)
  difflm generate .difflm/runs/<run> --prompt "The river" eval.sampler.threshold=0.9
  difflm adapt smollm2 train.train_iters=20 train.schedule.warmup_iters=2  # AR -> diffusion from SmolLM2

every command, its options and more examples: {DOCS}
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
        auth = f"difflm:{secrets.token_hex(16)}"
        os.environ.setdefault("PREFECT_SERVER_API_AUTH_STRING", auth)
        os.environ.setdefault("PREFECT_API_AUTH_STRING", os.environ["PREFECT_SERVER_API_AUTH_STRING"])
        os.environ.setdefault("PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED", "true")


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
    # one call of flows/commands.py, from the validated config and the parsed arguments; its exit code
    handler: Callable[[PipelineConfig, argparse.Namespace], int]
    args: tuple[Arg, ...] = ()
    # the run directory whose recorded config.yaml is this command's default config (None: none for these args)
    run_of: Callable[[argparse.Namespace], RunDir | None] | None = None
    default_preset: str = DEFAULT_PRESET  # --preset when neither it nor a run names one
    # the command's config when a file of its own names the preset (study: the spec's first point)
    config_of: Callable[[argparse.Namespace], PipelineConfig] | None = None


def preset_default(cmd: Command) -> str:
    """The one rule for `--preset`'s default, as each command's help says it."""
    if cmd.run_of:
        return f"the config.yaml the run recorded, else {cmd.default_preset}"
    return cmd.default_preset


def _run_of_conversion(args) -> RunDir | None:
    from difflm.tasks.sources import conversion_source

    return conversion_source(args.source).run  # a folder that is neither fails here, before any server


def _run_of_run_dir(args) -> RunDir | None:
    from difflm.tasks.sources import training_run_dir

    return training_run_dir(args.run_dir)  # a wrong path fails here, before any Prefect server starts


def _run_of_sources(args) -> RunDir | None:
    """The run the first SOURCE (eval, generate) belongs to, when it recorded its config and data; for a models:/
    source, the last `difflm run` of the workdir used last (whose MLflow store it is read from)."""
    for source in getattr(args, "sources", None) or [args.source]:
        run = _last_run() if source.startswith("models:/") else RunDir.holding(Path(source).expanduser())
        if run is not None and run.has_inputs():
            return run
    return None


def _last_run() -> RunDir | None:
    last = Workdir.last()
    summary = last.last_run() if last else None
    return RunDir(summary["run_dir"]) if summary and summary.get("run_dir") else None


def _run_of_served(args) -> RunDir | None:
    return _run_of_run_dir(args) if args.served == "evaluate-latest" and args.run_dir else None


def _study_config(args) -> PipelineConfig:
    """The first point's config (its workdir holds Prefect's state); every point is checked here."""
    return study_spec(args.spec, args.preset, args.overrides).points()[0].cfg


SOURCE_HELP = "export folder, run directory, or models:/<name>/<version> | models:/<name>@<alias>"
ADAPT_SOURCE_HELP = "an HF folder (Llama/Qwen2/Qwen3/Mistral or an ar export), or smollm2"

COMMANDS = (
    Command(
        "run",
        "run the pretrain-difflm flow end to end (data, train, export, eval, MLflow)",
        "Run the Prefect flow pretrain-difflm: data prep, torchrun training, HF export, evaluation, MLflow tracking "
        "and model registration. Finished stages are reused; an interrupted run resumes.",
        lambda cfg, a: commands.run(cfg),
    ),
    Command(
        "config",
        "show the resolved configuration, list presets, or print the JSON schema",
        "Print the configuration the other commands would use with the same --preset and overrides (show), the "
        "preset files (presets), or the JSON schema of every field (schema).",
        lambda cfg, a: commands.config(cfg, a.action),
        (arg("action", nargs="?", default="show", choices=["show", "presets", "schema"], help="default: show"),),
    ),
    Command(
        "prep",
        "data prep only: datatrove -> tokenized Megatron .bin/.idx + manifest",
        "Read data.sources, clean, split, tokenize and write verified Megatron datasets; reruns finish "
        "interrupted work.",
        lambda cfg, a: commands.prep(cfg, a.flow),
        (flow_flag("data-prep"),),
    ),
    Command(
        "verify",
        "re-read and check every shard of the config's finished data prep",
        "Re-read every shard of this config's data prep and check it against its manifest.",
        lambda cfg, a: commands.verify(cfg),
    ),
    Command(
        "train",
        "data prep (reused) + training only, no Prefect/MLflow",
        "Prepare the data (reused when done), then train with train.launch.launcher (local torchrun, or a Slurm job or "
        "Kubernetes PyTorchJob it submits and waits for). Prints the run directory and checkpoint.",
        lambda cfg, a: commands.train(cfg),
    ),
    Command(
        "launch",
        "write a Slurm script or Kubernetes PyTorchJob that trains this config",
        "Prepare the data, then write a cluster launch file for torchrun on train.launch.nnodes x train.launch.nproc_per_node "
        "GPUs into the run directory, to submit yourself. The options below set the config fields they name.",
        lambda cfg, a: commands.launch(cfg, a.target),
        (
            arg("--target", choices=["slurm", "k8s", "kubernetes"], default="slurm", help="default: slurm"),
            arg(
                "--partition",
                sets="train.launch.slurm.partition",
                help="Slurm partition (sets train.launch.slurm.partition)",
            ),
            arg("--time", sets="train.launch.slurm.time", help="Slurm time limit (sets train.launch.slurm.time)"),
            arg(
                "--python",
                sets="train.launch.slurm.python",
                help="python on the nodes (sets train.launch.slurm.python)",
            ),
            arg(
                "--image",
                sets="train.launch.kubernetes.image",
                help="container image (sets train.launch.kubernetes.image)",
            ),
            arg(
                "--pvc",
                sets="train.launch.kubernetes.pvc",
                help="claim holding the workdir (sets train.launch.kubernetes.pvc)",
            ),
        ),
    ),
    Command(
        "convert",
        "megatron checkpoint <-> Hugging Face folder; the direction follows from SOURCE",
        "Convert a run directory or megatron checkpoint to a Hugging Face export, or an HF export or stock HF "
        "folder to a megatron checkpoint; the direction follows from SOURCE. An --out folder holding anything "
        "else is never replaced.",
        lambda cfg, a: commands.convert(cfg, a.source, a.out, a.flow),
        (
            arg("source", metavar="SOURCE", help="run directory, megatron checkpoint folder, or HF export folder"),
            arg("--out", default=None, help="output folder (default: <run>/exports/iter_XXXXXXX, or beside SOURCE)"),
            flow_flag("convert-checkpoint"),
        ),
        run_of=_run_of_conversion,
    ),
    Command(
        "eval",
        "score exports, run directories or registered versions on the data's tasks",
        "For each SOURCE: the likelihood bound on held-out windows, the tasks built from the held-out split and "
        "samples, on the data and config its run recorded; one table. data.* overrides score other data, into "
        "<run>/eval-<data hash>.",
        lambda cfg, a: commands.evaluate(cfg, a.sources, a.preset, a.overrides, a.out, a.tracking_uri, a.flow),
        (
            arg("sources", nargs="+", metavar="SOURCE", help=SOURCE_HELP),
            arg("--out", default=None, help="results folder (default: <run>/eval, or <workdir>/evals/<source>)"),
            arg("--tracking-uri", default=None, help="MLflow store for models:/ sources (default: the config's)"),
            flow_flag("evaluate"),
        ),
        run_of=_run_of_sources,
    ),
    Command(
        "eval-latest",
        "score a training run's newest checkpoint, while it trains, into MLflow",
        "Run the Prefect flow evaluate-latest once: export the newest complete checkpoint of RUN_DIR, score its "
        "held-out likelihood bound and log it to MLflow at that iteration; a checkpoint scored before is skipped.",
        lambda cfg, a: commands.eval_latest(a.run_dir, a.preset, a.overrides, a.max_sequences, a.force),
        (
            arg("run_dir", metavar="RUN_DIR", help="training run directory (<workdir>/runs/<run>)"),
            arg("--max-sequences", type=int, default=16, help="held-out windows to score (default: 16)"),
            arg("--force", action="store_true", help="score the newest checkpoint even if scored before"),
        ),
        run_of=_run_of_run_dir,
    ),
    Command(
        "generate",
        "sample from an export with the configured sampler",
        "Generate after each --prompt (default: the first words of held-out documents) with the sampler "
        "eval.sampler.*.",
        lambda cfg, a: commands.generate(cfg, a.source, a.prompt, a.max_new_tokens, a.json, a.tracking_uri),
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
        "Run the Prefect flow adapt-difflm: import SOURCE's weights, adapt them into a diffusion LM, export it, "
        "and evaluate it beside the source AR model on the same held-out tokens and task items.",
        lambda cfg, a: commands.adapt(cfg, a.source, a.preset or "adapt-dream", a.overrides),
        (arg("source", metavar="SOURCE", help=ADAPT_SOURCE_HELP),),
        default_preset="adapt-dream",
    ),
    Command(
        "study",
        "run a data-constrained study (families x unique tokens x epochs x sizes): flow study",
        "Run the Prefect flow study on SPEC, a YAML grid: every point a cached run of pretrain-difflm nested in one "
        "MLflow parent run, scored on the same held-out tokens; points already done are reused. Writes the results "
        "table, the plot and the crossover per budget to <workdir>/studies/<name>. --preset replaces the spec's "
        "preset; overrides join its base.",
        lambda cfg, a: (
            commands.study_plan(a.spec, a.preset, a.overrides, a.device, a.mfu)
            if a.plan
            else commands.study(cfg, a.spec, a.preset, a.overrides)
        ),
        (
            arg("spec", metavar="SPEC", help="the study's YAML file (see docs/study.md)"),
            arg(
                "--plan",
                action="store_true",
                help="print each point's parameters, steps, tokens, training FLOPs and device-hours, and the total; "
                "run nothing",
            ),
            arg("--device", default="H200", help="--plan: the device the hours are of (H100, H200, B200, A100...)"),
            arg(
                "--mfu",
                type=float,
                default=0.4,
                help="--plan: the model FLOPs utilisation assumed (default 0.4; a 1B model measured 0.477 on an "
                "H200, docs/gpu-check.md)",
            ),
        ),
        default_preset="the spec's preset",
        config_of=_study_config,
    ),
    Command(
        "serve",
        "serve a flow (pretrain-difflm, adapt-difflm or evaluate-latest) as a Prefect deployment, optionally scheduled",
        "Register a deployment of FLOW and run its flow runs in this process until stopped (Ctrl-C): "
        "pretrain-difflm on the config, adapt-difflm on --source, or evaluate-latest on --run-dir (default: every "
        "600 s). One flow run at a time per deployment: a late run waits, or with pipeline.late_runs=cancel is "
        "cancelled.",
        lambda cfg, a: commands.serve(
            cfg,
            a.served,
            a.name,
            a.cron,
            a.interval,
            a.run_dir,
            a.max_sequences,
            a.preset,
            DEFAULT_PRESET,
            a.overrides,
            a.source,
        ),
        (
            arg("served", metavar="FLOW", choices=SERVED, help="the flow to serve"),
            arg("--name", default="demo", help="deployment name (run it: prefect deployment run 'FLOW/NAME')"),
            arg("--cron", default=None, help="cron schedule, e.g. '0 3 * * *'"),
            arg("--interval", type=float, default=None, help="interval in seconds (evaluate-latest default: 600)"),
            arg("--run-dir", default=None, help="evaluate-latest: the training run directory to score"),
            arg("--source", default=None, help="adapt-difflm: the HF folder (or smollm2) to adapt"),
            arg("--max-sequences", type=int, default=16, help="evaluate-latest: held-out windows per score"),
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
            description=cmd.description,
            epilog=f"in detail, with examples: {DOCS}#{cmd.name}",
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
        hint = f" (configuration overrides take no dashes: {' '.join(dashed)}; `difflm config show` lists every field)"
        hint = hint if dashed else ""
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
    if cmd.config_of:
        return cmd.config_of(args)
    run = cmd.run_of(args) if cmd.run_of and not args.preset else None
    if run is not None:
        from difflm.tasks.sources import stage_config

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
    # megatron warns at import that Apex/TE are absent; on a CPU that is expected, not news
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*")
    warnings.formatwarning = _one_line_config_warnings(warnings.formatwarning)
    args = _parse(argv)
    cmd = BY_NAME[args.command]
    before = {k: os.environ.get(k) for k in TEMPORARY_SERVER_AUTH}
    try:
        # what the pipeline writes (data, checkpoints, exports, Prefect state) is not for other users of the
        # host, also in the trainers it starts
        with private_umask(), _sigterm_as_ctrl_c():
            return _main(cmd, args)
    finally:
        for key, value in before.items():  # an in-process caller (tests) keeps its own environment
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _one_line_config_warnings(format_other: Callable[..., str]) -> Callable[..., str]:
    """warnings.formatwarning that prints a ConfigWarning as `warning: <message>` and others as before."""
    if getattr(format_other, "config_warnings_one_line", False):  # main() called again in one process
        return format_other

    def formatwarning(message, category, filename, lineno, line=None) -> str:
        if issubclass(category, ConfigWarning):
            return f"warning: {message}\n"
        return format_other(message, category, filename, lineno, line)

    formatwarning.config_warnings_one_line = True  # type: ignore[attr-defined]
    return formatwarning


@contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM (`kill`, a scheduler) ends a command as Ctrl-C does: by the exception, so that what it started (the
    temporary Prefect server) is stopped on the way out; by default it ended the process at once, leaving the server
    running. (While training, the launcher treats both signals as a request to checkpoint and stop.)"""
    if threading.current_thread() is not threading.main_thread():  # handlers belong to the main thread
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(cmd, args) -> int:
    try:
        check_arguments(cmd.name, args)  # a mistyped path, before the config (and torch) is loaded
        cfg = resolve_config(cmd, args)
        check_before_work(cmd.name, cfg, args)  # what needs no server fails before one starts
        _offline_env(cfg)  # Prefect's state beside the config's workdir (a run's own, for a command on a run)
        runs_flow = cmd.name == "run" or (cmd.name == "study" and not args.plan)
        flows = runs_flow or bool(getattr(args, "flow", False))
        # first the reaper (what this command starts dies with it), then the Prefect server, then the record
        # of this command's runs (kept, should it be killed, for the next command to mark them failed)
        with reaped() if flows or cmd.name in STARTS_PROCESSES else nullcontext(), prefect_api(needed=flows):
            if not flows:
                return cmd.handler(cfg, args)
            workdir = Path(cfg.workdir).resolve()
            mark_dead_runs(workdir)
            with live_runs.recorded(workdir, cmd.name):
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
