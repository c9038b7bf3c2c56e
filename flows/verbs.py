"""The `difflm` verbs as data: one `Command` row per verb (name, help, arguments, handler), which `flows/cli.py`
turns into argparse and runs. Each handler is one call of `flows/commands.py`; what each verb does in detail, with
examples, is docs/cli.md (each `--help` points there), so the rows keep to one line of help and one paragraph."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from difflm.config import PipelineConfig, load_config, study_spec
from difflm.flows import commands, eval_commands
from difflm.rundir import RunDir, Workdir, in_source_workdir

DEFAULT_PRESET = "tiny-cpu"
SERVED = ["pretrain-difflm", "adapt-difflm", "evaluate-latest"]  # what `difflm serve` serves


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
    reproduce = getattr(args, "reproduce", None)
    for source in getattr(args, "sources", None) or ([_record_export(reproduce)] if reproduce else [args.source]):
        run = _last_run() if source.startswith("models:/") else RunDir.holding(Path(source).expanduser())
        if run is not None and run.has_inputs():
            return run
    return None


def _record_export(record: str) -> str:
    """The export an evaluation record scored (`eval --reproduce`): its run's config is the rerun's."""
    from difflm.models.evaluation.record import EvalRecord

    return EvalRecord.read(record).export


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
SFT_SOURCE_HELP = "run directory, export folder, models:/<name>/<version> | models:/<name>@<alias>, or an HF folder"


def _sft_config(args) -> PipelineConfig:
    """The preset, in the workdir of a SOURCE that lies in a run (its Prefect state and MLflow store)."""
    return load_config(args.preset or "sft-tiny", in_source_workdir(args.source, args.overrides))


def _sft(cfg: PipelineConfig, a: argparse.Namespace) -> int:
    from difflm.flows.sft import sft_command  # Prefect: imported once the CLI has set PREFECT_HOME (commands.py)

    return sft_command(cfg, a.source, a.preset or "sft-tiny", a.overrides)


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
        lambda cfg, a: commands.convert(cfg, a.source, a.out, a.flow, a.format),
        (
            arg("source", metavar="SOURCE", help="run directory, megatron checkpoint folder, or HF export folder"),
            arg("--out", default=None, help="output folder (default: <run>/exports/iter_XXXXXXX, or beside SOURCE)"),
            arg(
                "--format",
                default="difflm",
                choices=["difflm", "llada", "dream", "gguf"],
                help="a checkpoint's export layout: difflm (default: this project's, AutoModel with remote code), "
                "llada (LLaDAModelLM: difflm-noshift), dream (DreamModel: difflm-shift), gguf (the mode's layout "
                "plus model.gguf for llama.cpp's llama-diffusion-cli); written to <out> or iter_XXXXXXX-<format>",
            ),
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
        lambda cfg, a: (
            eval_commands.reproduce(a.reproduce, a.overrides, a.out)
            if a.reproduce
            else eval_commands.evaluate(cfg, a.sources, a.preset, a.overrides, a.out, a.tracking_uri, a.flow, a.force)
        ),
        (
            arg("sources", nargs="*", metavar="SOURCE", help=SOURCE_HELP),
            arg("--out", default=None, help="results folder (default: <run>/eval, or <workdir>/evals/<source>)"),
            arg("--tracking-uri", default=None, help="MLflow store for models:/ sources (default: the config's)"),
            arg("--force", action="store_true", help="evaluate again even where a record of the same settings exists"),
            arg(
                "--reproduce",
                metavar="RECORD",
                default=None,
                help="rerun an evaluation record (results.json or its folder) with its model, data and settings, "
                "and say whether each score is within its standard error",
            ),
            flow_flag("evaluate"),
        ),
        run_of=_run_of_sources,
    ),
    Command(
        "compare",
        "evaluation records side by side: a table and accuracy against TPF and tokens/s",
        "One point per decoding setting of each RECORD (results.json or an evaluation folder: its own decoding, its "
        "sweep, its AR baseline): compare.md, compare.json and compare.png in --out, and an MLflow run. Records "
        "from different machines compare by TPF, NFE and AUP (tokens/s left out).",
        lambda cfg, a: eval_commands.compare(cfg, a.records, a.out),
        (
            arg("records", nargs="+", metavar="RECORD", help="results.json files or evaluation folders"),
            arg("--out", default=None, help="output folder (default: <workdir>/reports/compare-<time>)"),
        ),
    ),
    Command(
        "eval-latest",
        "score a training run's newest checkpoint, while it trains, into MLflow",
        "Run the Prefect flow evaluate-latest once: export the newest complete checkpoint of RUN_DIR, score its "
        "held-out likelihood bound and log it to MLflow at that iteration; a checkpoint scored before is skipped.",
        lambda cfg, a: eval_commands.eval_latest(a.run_dir, a.preset, a.overrides, a.max_sequences, a.force),
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
        lambda cfg, a: eval_commands.generate(cfg, a.source, a.prompt, a.max_new_tokens, a.json, a.tracking_uri),
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
        "sft",
        "instruction-tune a pretrained model (run, export, models:/ or HF folder): flow sft-difflm",
        "Run the Prefect flow sft-difflm: import SOURCE's weights, prepare the preset's instruction data through its "
        "tokenizer, fine-tune on the responses, export, score the held-out instructions before and after (exact "
        "match, the responses' NLL) and register the tuned model with the pretrained run as its lineage.",
        lambda cfg, a: _sft(cfg, a),
        (arg("source", metavar="SOURCE", help=SFT_SOURCE_HELP),),
        default_preset="sft-tiny",
        config_of=_sft_config,
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
                help="print each point's parameters, real steps, tokens, training FLOPs and device-hours, the total, "
                "and the points the run would refuse; trains nothing (prepares the data if missing)",
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
