"""`difflm`: the command line of the pipeline, on the top floor (it dispatches to flows and stages).

One verb per job, each a row of COMMANDS (flows/verbs.py: name, help, arguments, handler); every handler turns
argparse's namespace into one call of `flows/commands.py`. Every command takes `--preset` (a name in configs/ or a YAML path) and
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
from pathlib import Path
from typing import Any

from difflm import live_runs, set_offline_env
from difflm.config import PipelineConfig, load_config, validate
from difflm.errors import ConfigWarning, UserError, disk_full, is_disk_full
from difflm.flows.dead_runs import mark_dead_runs
from difflm.flows.prechecks import check_arguments, check_before_work
from difflm.flows.prefect_api import prefect_api
from difflm.flows.verbs import (  # the table, and what callers read through this module
    BY_NAME,
    COMMANDS,
    DEFAULT_PRESET,  # noqa: F401
    REMOVED,
    REMOVED_OPTIONS,
    SERVED,  # noqa: F401
    Command,
    preset_default,
)
from difflm.outputs import private_umask
from difflm.reaper import reaped

# Stages, flows and models are imported inside flows/commands.py's functions, `_run_of_*` and `resolve_config`
# (difflm.tasks.sources): `difflm --help` then loads argparse and the config only (well under a second), and a
# command loads only what it runs (torch, megatron, Prefect and MLflow take seconds to import).

# besides every command that runs a flow (a Prefect server), these start processes that must not outlive them
# (torchrun and its ranks, data-prep workers, served flow runs): they run under difflm.reaper
STARTS_PROCESSES = {"prep", "train", "adapt", "sft", "serve"}
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
    if args.command == "eval" and not args.sources and not args.reproduce:
        parser.error(
            "eval needs at least one SOURCE (export folder, run directory or models:/name/version), or "
            "--reproduce RECORD"
        )
    if args.command == "eval" and args.sources and args.reproduce:
        parser.error("eval --reproduce RECORD reruns the record's own model: give no SOURCE beside it")
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
        runs_flow = cmd.name in ("run", "sft") or (cmd.name == "study" and not args.plan)
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
