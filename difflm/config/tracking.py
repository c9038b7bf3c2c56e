"""The MLflow tracking section."""

from __future__ import annotations

from pydantic import (
    Field,
)

from difflm.config.base import _Section


class TrackingConfig(_Section):
    enabled: bool = True
    tracking_uri: str | None = Field(None, description="MLflow URI (None: sqlite store in the workdir).")
    experiment: str = "difflm"
    registry: bool = Field(
        True,
        description="Register the HF export as a version of a registered model "
        "(false: it is only logged as an artifact of the run).",
    )
    registered_model: str | None = Field(
        None,
        description="Registered model name (None: difflm-<preset name>-<mode>, so each preset and mode has "
        "its own model and champion; an empty string disables registration, as registry: false does).",
    )
    champion_metric: str = Field(
        "eval.trained.nll_per_token",
        description="Run metric that decides the `champion` alias: a new version "
        "takes it only when strictly better than the champion's (default: the validation ELBO/NLL in nats/token).",
    )
    champion_higher_is_better: bool = Field(
        False, description="True for scores (e.g. eval.cloze.acc); False for losses and bounds."
    )
    system_metrics: bool = Field(
        True,
        description="Sample CPU, memory, disk, network (and GPU) utilisation into the training stage's "
        "MLflow run while it trains (MLflow's system metrics, every 10 s).",
    )
    pipeline_user: str | None = Field(
        None,
        description="The MLflow user the pipeline registers versions as. On a server with accounts a registered "
        "model is trusted (loaded, promoted, registered into) only when this user holds MANAGE on it and nobody "
        "outside it and trusted_registrants may write to it (the server's permissions); on a store without "
        "accounts a version is loaded only when its registrant tag names this user or one of trusted_registrants "
        "(None: the user this process authenticates as, MLFLOW_TRACKING_USERNAME, else the local user name).",
    )
    trusted_registrants: list[str] = Field(
        default_factory=list,
        description="Other MLflow users who may write to the pipeline's registered model (EDIT, MANAGE, admin) "
        "without its versions being refused; by default only the pipeline user may. Another user who can write "
        "to it could otherwise put her weights (and code) behind the pipeline's model name and aliases.",
    )
