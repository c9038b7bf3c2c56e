"""Every check of a command's inputs that needs no server, run by the CLI before anything starts.

`check_before_work(command, cfg, args)` runs after the configuration is validated and before the CLI starts a
Prefect server, a data prep or a trainer: the paths the command reads exist and are folders of the kind it reads,
a pretrained source gives a valid configuration, a checkpoint's `common.pt` passes the weights-only loader, and the
model fits the memory it would train in. A wrong path then costs one line within a second or two, not a
server start, a flow run and a traceback (43 s, tried as a new user would).

The cheap checks (a path exists) come first and import nothing heavy; the deeper ones (a source's config.json,
a checkpoint's pickles) import their modules inside the functions, for the commands that need them: torch,
transformers and datatrove take seconds to import, and `difflm --help` loads this module.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from difflm.config import PipelineConfig
from difflm.errors import UserError
from difflm.memory import check_fits, gpu_memory
from difflm.models.hf.examples import EXAMPLE_SOURCES

EXPORT_HINT = "pass an export folder, a run directory, or models:/<name>/<version> | models:/<name>@<alias>"


class InputError(UserError):
    """A path a command reads does not exist or is not what the command reads; the message says what to pass."""


def check_arguments(command: str, args: argparse.Namespace) -> None:
    """Raise a UserError, before the configuration is even built, for a path `command`'s arguments name that is
    not there: a mistyped folder is one line in well under 2 s."""
    check = ARGUMENT_CHECKS.get(command)
    if check is not None:
        check(args)


def check_before_work(command: str, cfg: PipelineConfig, args: argparse.Namespace) -> None:
    """Raise a UserError, before any server or process starts, for what `command` would fail on later."""
    check = CHECKS.get(command)
    if check is not None:
        check(cfg, args)


def _must_exist(path: str, what: str, hint: str) -> Path:
    found = Path(path).expanduser()
    if not found.exists():
        raise InputError(f"{what} {path}: no such file or folder; {hint}")
    return found


def _data(cfg: PipelineConfig) -> None:
    """The data sources and tokenizer, unless this config's data prep is finished (then they are not read)."""
    from difflm.data_prep.pipeline import (  # datatrove: seconds; for commands that prep data
        MANIFEST,
        data_dir,
        preflight,
    )

    if not (data_dir(cfg) / MANIFEST).exists():
        preflight(cfg)


def _training(cfg: PipelineConfig) -> None:
    """A training command: its data, its starting point and its size."""
    _data(cfg)
    train = cfg.train
    if train.init_from_hf:
        from difflm.tasks.adapt import resolve_source, with_source  # torch, transformers: only with a source to read

        source = _must_exist(train.init_from_hf, "train.init_from_hf", "pass a Hugging Face model folder")
        cfg = with_source(cfg, resolve_source(str(source)))  # the source's architecture is the model's
    if train.init_from:
        _checkpoint(train.init_from, "train.init_from")
    check_fits(cfg)
    if cfg.model.cuda_graphs != "off" and train.launch.launcher == "local":
        from difflm.models.megatron.kernels import check_cuda_graphs  # torch: only with the switch on

        check_cuda_graphs(cfg.model.cuda_graphs, cuda=gpu_memory() is not None)


def _checkpoint(path: str, what: str) -> None:
    from difflm.models.megatron.safe_pickle import check_common  # torch: only with a checkpoint to read

    hint = "pass a megatron checkpoint folder (`difflm convert HF_DIR --out CKPT` writes one)"
    folder = _must_exist(path, what, hint)
    if not (folder / "metadata.json").is_file():
        raise InputError(f"{what} {path}: not a megatron distributed checkpoint (no metadata.json); {hint}")
    check_common(folder)


def _run(cfg: PipelineConfig, args: argparse.Namespace) -> None:
    _training(cfg)


def _prep(cfg: PipelineConfig, args: argparse.Namespace) -> None:
    _data(cfg)


HF_HINT = "or a Hugging Face model folder (Llama/Qwen2/Qwen3/Mistral)"


def _adapt_source(args: argparse.Namespace) -> None:
    if args.source not in EXAMPLE_SOURCES:
        names = ", ".join(EXAMPLE_SOURCES)
        _must_exist(args.source, "SOURCE", f"pass a Hugging Face model folder (Llama/Qwen2/Qwen3/Mistral) or {names}")


def _sft_source(args: argparse.Namespace) -> None:
    if args.source not in EXAMPLE_SOURCES and not args.source.startswith("models:/"):
        _must_exist(
            args.source, "SOURCE", f"pass a run directory, an export folder, models:/<name>/<version>, {HF_HINT}"
        )


def _adapt(cfg: PipelineConfig, args: argparse.Namespace) -> None:
    from difflm.tasks.adapt import adaptation_config  # torch, transformers: the source's folder is read

    adapted, _ = adaptation_config(args.source, args.preset or "adapt-dream", args.overrides)
    _training(adapted)


def _convert_source(args: argparse.Namespace) -> None:
    _must_exist(args.source, "SOURCE", "pass a run directory, a megatron checkpoint folder or a Hugging Face folder")


def _convert(cfg: PipelineConfig, args: argparse.Namespace) -> None:
    from difflm.tasks.sources import conversion_source  # the stages' modules: only once the path exists

    found = conversion_source(args.source)
    if found.to == "hf":
        _checkpoint(str(found.path), "checkpoint")


def _sources(args: argparse.Namespace) -> None:
    if getattr(args, "reproduce", None):
        _must_exist(args.reproduce, "RECORD", "pass an evaluation's results.json or its folder (<run>/eval)")
        return
    for source in getattr(args, "sources", None) or [args.source]:
        if not source.startswith("models:/"):
            _must_exist(source, "SOURCE", EXPORT_HINT)


def _records(args: argparse.Namespace) -> None:
    for record in args.records:
        _must_exist(record, "RECORD", "pass evaluations' results.json files or their folders (<run>/eval)")


def _run_dir(args: argparse.Namespace) -> None:
    if getattr(args, "run_dir", None):
        _must_exist(args.run_dir, "RUN_DIR", "pass <workdir>/runs/<run>, the run_dir `difflm run` prints")


# the paths a command's arguments name: checked before its configuration is built (that imports torch, about 2.5 s)
ARGUMENT_CHECKS: dict[str, Callable[[argparse.Namespace], None]] = {
    "adapt": _adapt_source,
    "sft": _sft_source,
    "convert": _convert_source,
    "eval": _sources,
    "generate": _sources,
    "eval-latest": _run_dir,
    "compare": _records,
    "serve": _run_dir,
}

CHECKS: dict[str, Callable[[PipelineConfig, argparse.Namespace], None]] = {
    "run": _run,
    "train": _run,
    "prep": _prep,
    "adapt": _adapt,
    "convert": _convert,
}
