"""Where an export comes from: an export folder, a run directory, or a registered MLflow model version."""

from __future__ import annotations

import os
from pathlib import Path

from difflm.config import TrackingConfig
from difflm.errors import UserError
from difflm.rundir import RunDir
from difflm.tracking import download_model_version


class SourceError(UserError, ValueError):
    """The model source cannot be resolved; the message says what was expected."""


def resolve_export(source: str, tracking_uri: str | None = None, tracking: TrackingConfig | None = None) -> Path:
    """The HF export folder for `source`:
    - a folder with config.json (an export, e.g. <run dir>/hf);
    - a run directory (<workdir>/runs/<run>): its `hf` export;
    - `models:/<name>/<version>` or `models:/<name>@<alias>`: the registered version, downloaded from MLflow
      (`tracking_uri`, else $MLFLOW_TRACKING_URI), when the server records the model as the pipeline user's
      and `tracking`'s trusted_registrants' alone (on a store without accounts: when its registrant tag names one)."""
    if source.startswith("models:/"):
        return _download(source, tracking_uri, tracking)
    path = Path(source).expanduser()
    if (path / "config.json").exists():
        return path
    run = RunDir(path)
    if (run.hf / "config.json").exists():
        return run.hf
    if run.checkpoints.is_dir():
        raise SourceError(
            f"{path} is a run directory without an HF export (hf/): finish it with `difflm run` "
            "and the same preset and overrides, which exports the last checkpoint, or export its newest "
            f"checkpoint with `difflm convert {path}` and evaluate that folder"
        )
    raise SourceError(f"{source}: not an export folder (config.json), a run directory (hf/) or models:/name/version")


def _download(uri: str, tracking_uri: str | None, tracking: TrackingConfig | None) -> Path:
    store = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not store:
        raise SourceError(f"{uri}: set --tracking-uri or MLFLOW_TRACKING_URI to the MLflow store it is registered in")
    local = Path(store.removeprefix("sqlite:///")) if store.startswith("sqlite:///") else None
    if local is not None and not local.is_file():  # MLflow would create an empty store there, then not find it
        raise SourceError(
            f"{uri}: no MLflow store at {local} (no run registered a model there): run `difflm run` first, or "
            "name the store with --tracking-uri, or the preset whose workdir holds it with --preset"
        )
    try:
        return download_model_version(uri, store, tracking)
    except LookupError as err:
        raise SourceError(str(err)) from err
