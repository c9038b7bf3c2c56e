"""The on-disk layout of a training run directory, in one place (as nanochat's checkpoint_manager owns its own).

    <workdir>/runs/<mode>-<data hash>-<train hash>/
        config.yaml            the config it was trained with (what every later command defaults to)
        data_manifest.json     the data it was trained on: hash, tokenizer (with its sha256), splits
        metrics.jsonl          every training metric, appended as it is logged
        train.log, curves.png  torchrun's output; the loss curves
        checkpoints/           iter_0000100/ ... (megatron distributed checkpoints) and `latest`: the newest
                               complete iteration, written only after its save finished
        hf/                    the Hugging Face export of the final checkpoint (difflm_export.json names it)
        exports/iter_XXXXXXX/  exports of other checkpoints (`difflm convert`)
        eval/                  results.json, lm-eval task files and .cache_key: the evaluation on the run's own data
        eval-<data hash>/      an evaluation on other data (explicit data overrides), never over eval/
        eval_latest/           hf/ and scores.json of evaluate-latest
        preempted.json, stopped.json   why the trainer stopped (resume me; non-finite values)

The workdir around the runs is `Workdir`: `runs/` (named by `Workdir.run_for`), `data/<data hash>/`,
`imports/<source>/` (`ImportDir`), `evals/`, `reports/`, `mlflow.db`, `mlartifacts/`, `last_run.json` and `.live/` (the
locked records of the commands running on it, difflm.live_runs); the
workdir used last is named by `.difflm-last` in the current directory (`Workdir.remember`, `Workdir.last`). Every launcher returns a `TrainResult`.

Each stage's output folder has its lock file beside it (`lock_file`: `.<name>.lock`), held by the one process
writing it. An export (any folder with difflm_export.json) records the checkpoint it was written from: `exported_from`.
Only the standard library, pydantic-core, difflm.config and difflm.manifest: the launcher, the trainer, the flows and the CLI all
read it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic.dataclasses import dataclass
from pydantic_core import core_schema

from difflm.config import ConfigError, PipelineConfig, load_config
from difflm.manifest import DataManifest

CONFIG = "config.yaml"
MANIFEST = "data_manifest.json"
METRICS = "metrics.jsonl"
TRAIN_LOG = "train.log"
CURVES = "curves.png"
CHECKPOINTS = "checkpoints"
LATEST = "latest"  # in checkpoints/: the newest complete iteration
HF = "hf"
HF_STOCK = "hf-stock"  # an `ar` run's final checkpoint as the stock transformers class (no remote code)
ENGINES = "engines"  # engines/<format>: the final checkpoint in an engine's layout (config export.formats)
EXPORTS = "exports"
EVAL = "eval"
EVAL_LATEST = "eval_latest"
PREEMPTED = "preempted.json"  # written on a preemption signal: the launcher reads it as "resume me"
STOPPED = "stopped.json"  # written when training stops on non-finite values
EXPORT_MARKER = "difflm_export.json"  # in an HF export: {"checkpoint": the folder it was exported from, ...}
EVAL_KEY = ".cache_key"  # in an evaluation folder: what the pipeline's results there were computed for
SCORES = "scores.json"  # in eval_latest/: {iteration: score} of the checkpoints evaluate-latest scored
CHECKPOINT_METADATA = "metadata.json"  # in a megatron checkpoint folder: written last, so it marks one complete

RUNS, DATA, IMPORTS, EVALS, REPORTS, MLARTIFACTS = "runs", "data", "imports", "evals", "reports", "mlartifacts"
MLFLOW_DB = "mlflow.db"  # the local MLflow store in a workdir
LAST_RUN = "last_run.json"  # in a workdir: the summary of the last `difflm run`
LAST_POINTER = ".difflm-last"  # in the current directory: the absolute path of the workdir used last
# the config sections that determine the trained weights: their hash names the run (with the mode and data hash)
TRAIN_SECTIONS = ("model", "diffusion", "train", "parallel", "checkpoint")


# ---- checkpoints/ (no megatron needed to read which one is complete) ---------------------------------------


def iter_dir(root: Path, iteration: int) -> Path:
    """The folder of `iteration` in a checkpoints/ folder."""
    return Path(root) / f"iter_{iteration:07d}"


def latest_iteration(root: Path) -> int | None:
    """The newest complete iteration in a checkpoints/ folder (its `latest` file, when that checkpoint exists)."""
    marker = Path(root) / LATEST
    if not marker.exists():
        return None
    it = int(marker.read_text().strip())
    return it if iter_dir(root, it).exists() else None


def lock_file(folder: str | Path) -> Path:
    """The lock file of an output folder (or store file): `.<name>.lock` beside it, so it exists before the
    folder does and is never part of what the folder holds (`difflm.locks.exclusive` takes it)."""
    folder = Path(folder)
    return folder.parent / f".{folder.name}.lock"


def iteration_of(checkpoint: Path) -> int | None:
    """7 for .../iter_0000007, else None."""
    digits = Path(checkpoint).name.removeprefix("iter_")
    return int(digits) if Path(checkpoint).name.startswith("iter_") and digits.isdigit() else None


# ---- exports --------------------------------------------------------------------------------------------


def exported_from(folder: Path) -> str | None:
    """The checkpoint an HF export was written from (its difflm_export.json), or None for any other folder."""
    marker = Path(folder) / EXPORT_MARKER
    if not marker.exists():
        return None
    return json.loads(marker.read_text()).get("checkpoint")


def is_export_of(folder: Path, checkpoint: str | Path) -> bool:
    """Whether `folder` holds the export of `checkpoint` (and not of an older one)."""
    return exported_from(folder) == str(checkpoint)


class RunDir:
    """A training run directory: its paths, what it recorded, and what it holds."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunDir) and self.path == other.path

    def __hash__(self) -> int:
        return hash(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    # -- paths
    @property
    def config_file(self) -> Path:
        return self.path / CONFIG

    @property
    def manifest_file(self) -> Path:
        return self.path / MANIFEST

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS

    @property
    def train_log(self) -> Path:
        return self.path / TRAIN_LOG

    @property
    def curves(self) -> Path:
        return self.path / CURVES

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def hf(self) -> Path:
        """The export of the final checkpoint, written by the pipeline."""
        return self.path / HF

    @property
    def hf_stock(self) -> Path:
        """The final checkpoint of an `ar` run as the stock transformers class, written by the pipeline."""
        return self.path / HF_STOCK

    def engine_export(self, fmt: str) -> Path:
        """The final checkpoint in an engine's layout (`fmt`: llada, dream, gguf; config export.formats)."""
        return self.path / ENGINES / fmt

    @property
    def eval_latest(self) -> Path:
        return self.path / EVAL_LATEST

    @property
    def scores(self) -> Path:
        """eval_latest/scores.json: what evaluate-latest scored, by iteration."""
        return self.eval_latest / SCORES

    @property
    def preempted(self) -> Path:
        return self.path / PREEMPTED

    @property
    def stopped(self) -> Path:
        return self.path / STOPPED

    @property
    def markers(self) -> tuple[Path, Path]:
        """What the trainer leaves when it stops early: (preempted.json, stopped.json)."""
        return self.preempted, self.stopped

    def checkpoint(self, iteration: int) -> Path:
        return iter_dir(self.checkpoints, iteration)

    def export_dir(self, checkpoint: str | Path) -> Path:
        """Where `difflm convert` exports one of the run's checkpoints: exports/iter_XXXXXXX."""
        return self.path / EXPORTS / Path(checkpoint).name

    def eval_dir(self, data_hash: str | None = None) -> Path:
        """Evaluation results: eval/ on the run's own data; eval-<data hash>/ on other data, so an evaluation
        on other data never writes over the run's own results."""
        if data_hash is None or data_hash == self.data_hash():
            return self.path / EVAL
        return self.path / f"{EVAL}-{data_hash}"

    # -- what it recorded
    def is_run(self) -> bool:
        """A training run directory: the config it was trained with and its checkpoints/ folder."""
        return self.config_file.exists() and self.checkpoints.is_dir()

    def has_inputs(self) -> bool:
        """Its trainer's inputs were written: config.yaml and data_manifest.json (what evaluation defaults to)."""
        return self.config_file.exists() and self.manifest_file.exists()

    def config(self, overrides: list[str] | None = None) -> PipelineConfig:
        """The config the run was trained with, workdir = the folder holding runs/ (so MLflow and Prefect are
        the training's), then `overrides`."""
        workdir = [f"workdir={self.path.resolve().parent.parent}"] if self.path.resolve().parent.name == "runs" else []
        return load_config(str(self.config_file), [*workdir, *(overrides or [])])

    def manifest(self) -> DataManifest:
        """The data manifest the run was trained on (its tokenizer, held-out split, hash)."""
        return DataManifest.read(self.manifest_file)

    def data_hash(self) -> str | None:
        return self.manifest().hash if self.manifest_file.exists() else None

    def metrics(self) -> list[dict]:
        """Every record of metrics.jsonl (empty before the first one)."""
        path = self.metrics_file
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    # -- what it holds
    def latest_iteration(self) -> int | None:
        """The newest complete checkpoint's iteration (None before the first save finished)."""
        return latest_iteration(self.checkpoints)

    def is_finished(self, train_iters: int) -> bool:
        return self.latest_iteration() == train_iters

    def export_of(self, checkpoint: str | Path) -> Path | None:
        """A folder of the run that already holds the export of `checkpoint`: the pipeline's hf/, an earlier
        `difflm convert` (exports/iter_XXXXXXX) or what evaluate-latest scores (eval_latest/hf); None if none."""
        for folder in (self.hf, self.export_dir(checkpoint), self.eval_latest / HF):
            if is_export_of(folder, checkpoint):
                return folder
        return None

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        """Validated from a path and serialised as its text: a `TrainResult` crosses Prefect's JSON results."""
        return core_schema.no_info_plain_validator_function(
            lambda v: v if isinstance(v, RunDir) else cls(v),
            serialization=core_schema.plain_serializer_function_ser_schema(lambda r: str(r.path)),
        )

    @classmethod
    def holding(cls, folder: str | Path) -> RunDir | None:
        """The run directory that `folder` belongs to: a run itself, its checkpoints/, one checkpoint, or an export
        (followed to the checkpoint it names, wherever the export lies); None if none."""
        folder = Path(folder)
        source = exported_from(folder)
        if source:
            folder = Path(source)
        for candidate in (folder, folder.parent, folder.parent.parent):
            run = cls(candidate)
            if run.is_run():
                return run
        return None


def in_source_workdir(source: str, overrides: list[str]) -> list[str]:
    """`overrides` led by `workdir=<the workdir holding source>` when `source` lies in a run (a run directory or its
    export) and they name no workdir: a command on a run (`difflm sft`) writes beside it, one MLflow store for both."""
    run = None if source.startswith("models:/") else RunDir.holding(Path(source).expanduser().resolve())
    if run is None or any(o.split("=", 1)[0].strip() == "workdir" for o in overrides):
        return list(overrides)
    return [f"workdir={run.path.parent.parent}", *overrides]


@dataclass(frozen=True)
class TrainResult:
    """What every launcher (torchrun, Slurm, Kubernetes) returns for a finished run: the run directory, its final
    checkpoint, and whether it was already finished (reused, nothing trained). A pydantic dataclass, so it is
    stored and read back as JSON by Prefect's result store (the pipeline's cached stages)."""

    run: RunDir
    checkpoint: Path
    reused: bool

    @classmethod
    def of(cls, cfg: PipelineConfig, run: RunDir, reused: bool) -> TrainResult:
        return cls(run, run.checkpoint(cfg.train.train_iters), reused)

    @classmethod
    def read(cls, value: TrainResult | dict) -> TrainResult:
        """The result itself, or one a Prefect result store holds from before it was typed (a dict)."""
        if isinstance(value, TrainResult):
            return value
        return cls(RunDir(value["run_dir"]), Path(value["checkpoint"]), bool(value["reused"]))

    def to_dict(self) -> dict:
        """{'run_dir', 'checkpoint', 'reused'}: what `difflm train` prints."""
        return {"run_dir": str(self.run.path), "checkpoint": str(self.checkpoint), "reused": self.reused}


def is_checkpoint(folder: str | Path) -> bool:
    """A complete megatron checkpoint folder (its metadata.json is written last)."""
    return (Path(folder) / CHECKPOINT_METADATA).exists()


class ImportDir:
    """<workdir>/imports/<source sha256[:16]>-tp<TP>-<mask token hash>: a source imported once. `megatron/` the
    checkpoint of its weights, `hf-ar/` that checkpoint exported as an `ar` model, `eval-<data hash>/` its
    evaluation."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"ImportDir({str(self.path)!r})"

    @property
    def checkpoint(self) -> Path:
        return self.path / "megatron"

    @property
    def hf_ar(self) -> Path:
        return self.path / "hf-ar"

    def eval_dir(self, data_hash: str) -> Path:
        return self.path / f"eval-{data_hash}"

    def is_complete(self) -> bool:
        """The checkpoint was written whole (the importer writes metadata.json last)."""
        return is_checkpoint(self.checkpoint)


class Workdir:
    """The folder everything of a config lives in (`cfg.workdir`): its runs, prepared data, imports, evaluations
    of exports outside any run, reports, the local MLflow store and artifacts; the rule that names a run; and which
    workdir was used last.

    The one rule for "where did my results go": `difflm run` and `difflm adapt` write their workdir's absolute path
    to `.difflm-last` in the current directory (`remember`). What reads a run's results without naming a workdir
    reads that one (`last`): `models:/` sources of `difflm eval`/`generate` without --preset, `make mlflow-ui`, the
    docs' Python snippets. Each preset keeps its own workdir."""

    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()

    @classmethod
    def of(cls, cfg: PipelineConfig) -> Workdir:
        return cls(cfg.workdir)

    def __repr__(self) -> str:
        return f"Workdir({str(self.path)!r})"

    @property
    def runs(self) -> Path:
        return self.path / RUNS

    @property
    def evals(self) -> Path:
        return self.path / EVALS

    @property
    def reports(self) -> Path:
        return self.path / REPORTS

    @property
    def mlartifacts(self) -> Path:
        return self.path / MLARTIFACTS

    @property
    def mlflow_store(self) -> Path:
        """The local MLflow store (sqlite), when no tracking server is configured."""
        return self.path / MLFLOW_DB

    @property
    def last_run_file(self) -> Path:
        """The summary of the last `difflm run` here (hf_dir, run_dir, mlflow_uri, ...)."""
        return self.path / LAST_RUN

    def last_run(self) -> dict | None:
        """That summary, or None when no `difflm run` finished here."""
        return json.loads(self.last_run_file.read_text()) if self.last_run_file.exists() else None

    def remember(self, cwd: Path | None = None) -> Path:
        """Make this the workdir used last (the pointer `.difflm-last` in `cwd`, default the current directory)."""
        pointer = Path(cwd or Path.cwd()) / LAST_POINTER
        pointer.write_text(f"{self.path}\n")
        return pointer

    @classmethod
    def last(cls, cwd: Path | None = None) -> Workdir | None:
        """The workdir `remember`ed in `cwd` (default the current directory), if it still exists."""
        pointer = Path(cwd or Path.cwd()) / LAST_POINTER
        if not pointer.is_file():
            return None
        found = cls(pointer.read_text().strip())
        return found if found.path.is_dir() else None

    def data(self, data_hash: str) -> Path:
        """data/<hash of data + tokenizer settings>: the prepared data (`difflm.data_prep.pipeline`)."""
        return self.path / DATA / data_hash

    def run_for(self, cfg: PipelineConfig, manifest: DataManifest) -> RunDir:
        """runs/<mode>-<data hash>-<train hash>: the run that training `cfg` on the data of `manifest` writes."""
        return RunDir(self.runs / run_name(cfg, manifest.hash))

    def import_for(self, cfg: PipelineConfig, source_sha256: str) -> ImportDir:
        """An import depends on the source's weights, the mask token and the vocabulary padding (TP) only."""
        tp = cfg.parallel.tensor_model_parallel_size
        mask = hashlib.sha256(cfg.tokenizer.mask_token.encode()).hexdigest()[:8]
        return ImportDir(self.path / IMPORTS / f"{source_sha256[:16]}-tp{tp}-{mask}")


def run_name(cfg: PipelineConfig, data_hash: str) -> str:
    """<mode>-<data hash>-<hash of TRAIN_SECTIONS>: the name of the run training `cfg` on that data. A length in
    epochs is named by its steps: `cfg.with_unique_tokens` first."""
    if cfg.train.epochs is not None:
        raise ConfigError(
            f"train.epochs={cfg.train.epochs:g} is not yet a number of steps: it is converted with the prepared "
            "training split's tokens (PipelineConfig.with_unique_tokens) before the run is named"
        )
    return f"{cfg.diffusion.model_running_mode}-{data_hash}-{cfg.stage_hash(*TRAIN_SECTIONS)}"
