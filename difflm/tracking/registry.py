"""The model registry: one registered model per preset, mode and data, the alias `candidate` on every new
version, and `champion` only on a version whose evaluation beats the current champion's on the configured
metric, measured on the same data (a bound on other data or through another tokenizer is not comparable).

Plain MLflow client calls (no active run needed), so the rules are tested on a bare sqlite store.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import re
import struct
from pathlib import Path

from difflm.config import PipelineConfig, TrackingConfig
from difflm.errors import UserError
from difflm.manifest import DataManifest
from difflm.tracking.model_access import UntrustedModel as UntrustedModel  # re-exported: the registry's refusals
from difflm.tracking.model_access import check_model

CANDIDATE, CHAMPION = "candidate", "champion"
TAG_DATA = "data.hash"  # the prepared data (sources, cleaning, split, tokenizer) a version was scored on
# version tags: what was compared, its value, and what the registration decided (read back for the next one)
TAG_CHECKPOINT, TAG_METRIC, TAG_VALUE, TAG_PROMOTION = (
    "difflm.checkpoint",
    "champion_metric",
    "champion_metric_value",
    "promotion",
)


# who registered the version (the MLflow user of the registering process): shown, and checked before a version is
# loaded only where the store records no permissions (a local store, a server without accounts); on a server with
# accounts the tag proves nothing (the registrant writes it) and model_access.check_model decides
TAG_OWNER = "difflm.registered_by"


class UntrustedVersion(UserError):
    """A registered version whose registrant is neither the pipeline user nor a trusted one."""


def pipeline_user(t: TrackingConfig) -> str:
    """The MLflow user the pipeline registers as: `tracking.pipeline_user`, else the one this process
    authenticates as (MLFLOW_TRACKING_USERNAME), else the local user name (a store without accounts)."""
    return t.pipeline_user or os.environ.get("MLFLOW_TRACKING_USERNAME") or getpass.getuser()


def check_owner(tags: dict, t: TrackingConfig, what: str) -> str:
    """The version's registrant when it is the pipeline user or a trusted one; UntrustedVersion otherwise."""
    owner, me = tags.get(TAG_OWNER), pipeline_user(t)
    if owner and (owner == me or owner in t.trusted_registrants):
        return owner
    raise UntrustedVersion(
        f"{what} was registered by {owner or 'an unknown user (no ' + TAG_OWNER + ' tag)'}, not by the pipeline "
        f"user {me!r}: refused, nothing of it was loaded. If you trust that user, add them to "
        f"tracking.trusted_registrants (e.g. 'tracking.trusted_registrants=[{owner or 'NAME'}]')"
    )


# the SHA-256 of every file of the export, {relative path: hex digest}: a downloaded version is checked against it
TAG_FILES = "difflm.files_sha256"


class ExportMismatch(UserError):
    """A downloaded registered export differs from what was registered (replaced or altered in the store)."""


def export_digests(folder: Path) -> dict[str, str]:
    """{relative path: SHA-256} of every file under `folder`."""
    out = {}
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        h = hashlib.sha256()
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        out[path.relative_to(folder).as_posix()] = h.hexdigest()
    return out


def recorded_digests(tags: dict, what: str) -> dict[str, str]:
    """The file digests a version's tags recorded; ExportMismatch when there are none (nothing to check against)."""
    recorded = tags.get(TAG_FILES)
    if not recorded:
        raise ExportMismatch(
            f"{what} records no file digests ({TAG_FILES}): it was not registered by this pipeline (or before "
            f"digests were recorded), so what was downloaded cannot be checked; register it again (rerun the "
            f"pipeline) or load the folder itself after checking it"
        )
    return json.loads(recorded)


def verify_export(folder: Path, tags: dict, what: str) -> None:
    """Raise ExportMismatch when `folder` is not exactly the files whose digests the version's tags recorded."""
    want, got = recorded_digests(tags, what), export_digests(folder)
    changed = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
    if changed:
        raise ExportMismatch(
            f"{what} differs from what was registered ({', '.join(changed[:5])}"
            f"{' ...' if len(changed) > 5 else ''} changed, added or missing): refused, nothing of it was loaded. "
            f"Someone with write access to the MLflow artifacts altered it; register a trusted export again"
        )


def registered_model_name(cfg: PipelineConfig) -> str | None:
    """The name the export is registered under, or None when registration is off. Derived by default, one
    model per preset, mode and data (`difflm-tiny-cpu-difflm-noshift-enwiki`): a champion is only ever compared
    with models trained the same way on the same sources."""
    t = cfg.tracking
    if not t.registry or t.registered_model == "":
        return None
    if t.registered_model:
        return t.registered_model  # explicit: taken as given (MLflow validates it)
    derived = f"difflm-{cfg.name}-{cfg.diffusion.model_running_mode}-{cfg.data_label()}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", derived).strip("-.")  # a preset name may be anything


def ensure_model(client, name: str) -> None:
    try:
        client.get_registered_model(name)
    except Exception:  # MlflowException RESOURCE_DOES_NOT_EXIST
        client.create_registered_model(
            name,
            description="Diffusion LMs trained by difflm-pipeline (HF folders). "
            "Alias `candidate`: the newest version; `champion`: the best evaluated one.",
        )


def claim_model(client, name: str, uri: str, t: TrackingConfig) -> None:
    """`name` created when missing (its creator gets MANAGE on a server with accounts), then UntrustedModel unless
    the server records it as the pipeline's: registering into a name someone else created or may write to would
    put the pipeline's versions next to theirs, and promote against them."""
    ensure_model(client, name)
    check_model(uri, name, t, f"registering into registered model {name!r}")


def version_of_checkpoint(client, name: str, checkpoint: str):
    """The newest version registered from this checkpoint (a rerun that reused it), or None."""
    same = [v for v in client.search_model_versions(f"name='{name}'") if v.tags.get(TAG_CHECKPOINT) == checkpoint]
    return max(same, key=lambda v: int(v.version)) if same else None


def version_metric(client, mv, metric: str) -> float | None:
    """`metric` of a version: the value tagged at its registration, else its run's (older versions)."""
    if mv.tags.get(TAG_METRIC) == metric and mv.tags.get(TAG_VALUE) not in (None, ""):
        return float(mv.tags[TAG_VALUE])
    try:
        return client.get_run(mv.run_id).data.metrics.get(metric) if mv.run_id else None
    except Exception:  # the run was deleted
        return None


def champion_of(client, name: str):
    try:
        return client.get_model_version_by_alias(name, CHAMPION)
    except Exception:  # MlflowException: no such alias yet
        return None


def decide(
    value: float | None, champ_value: float | None, champ_version: str | None, metric: str, higher_is_better: bool
) -> tuple[bool, str]:
    """(promote?, the decision in words): strictly better than the champion, or the first with a value."""
    if value is None:
        return False, (f"kept champion v{champ_version}" if champ_version else "no champion") + f": no {metric} logged"
    if champ_version is None:
        return True, f"champion: first version with {metric} ({value:.4g})"
    if champ_value is None:
        return True, f"champion: {metric} {value:.4g}; champion v{champ_version} had none"
    better, worse = (">", "<=") if higher_is_better else ("<", ">=")
    if (value > champ_value) if higher_is_better else (value < champ_value):
        return True, f"champion ({metric} {value:.4g} {better} {champ_value:.4g} of v{champ_version})"
    return False, f"kept champion v{champ_version} ({metric} {value:.4g} {worse} {champ_value:.4g})"


def promote(client, name: str, version: str, metric: str, higher_is_better: bool) -> dict:
    """Alias `candidate` on `version`; `champion` too when it beats the champion. The decision is written to
    the version's tags and returned: {promotion, promoted, champion_version, aliases}."""
    version = str(version)  # an int from some stores, a string from others
    mv = client.get_model_version(name, version)
    client.set_registered_model_alias(name, CANDIDATE, version)
    value = version_metric(client, mv, metric)
    champ = champion_of(client, name)
    data, champ_data = mv.tags.get(TAG_DATA), champ.tags.get(TAG_DATA) if champ is not None else None
    if champ is not None and str(champ.version) == version:
        promoted, text = False, "already champion"
    elif data and champ_data and data != champ_data:  # same name, other data (cleaning, split or tokenizer)
        promoted, text = (
            False,
            f"kept champion v{champ.version}: not compared, it was scored on other data "
            f"(data.hash {champ_data}, this version {data}); move the alias by hand if this one should win",
        )
    else:
        promoted, text = decide(
            value,
            version_metric(client, champ, metric) if champ else None,
            str(champ.version) if champ else None,
            metric,
            higher_is_better,
        )
    if promoted:
        client.set_registered_model_alias(name, CHAMPION, version)
    for key, val in {
        TAG_METRIC: metric,
        TAG_VALUE: "" if value is None else repr(float(value)),
        TAG_PROMOTION: text,
    }.items():
        client.set_model_version_tag(name, version, key, val)
    champion = version if promoted else (str(champ.version) if champ else None)
    return {
        "promotion": text,
        "promoted": promoted,
        "champion_version": champion,
        "aliases": [CANDIDATE] + ([CHAMPION] if champion == version else []),
    }


def register_version(
    cfg: PipelineConfig,
    name: str,
    *,
    source: str,
    run_id: str,
    checkpoint: str,
    uri: str,
    hf_dir: Path | None = None,
    manifest: DataManifest | None = None,
    results: dict | None = None,
    lineage: dict | None = None,
) -> dict:
    """A version of `name` for `source` (logged by run `run_id` in the store at `uri`), described and promoted;
    or the version already registered from `checkpoint`, left as it is once its promotion was decided.
    `lineage`: the model it was trained from (adaptation, SFT: `source.*` tags and a line of the description).
    Returns {registered_model, version, promotion, promoted, champion_version, aliases}."""
    from mlflow.tracking import MlflowClient  # mlflow takes seconds to import: loaded only when a version is registered

    client = MlflowClient(uri)
    claim_model(client, name, uri, cfg.tracking)
    out = {"registered_model": name}
    mv = version_of_checkpoint(client, name, checkpoint)
    if mv is not None and TAG_PROMOTION in mv.tags:
        champ = champion_of(client, name)
        return {
            **out,
            "version": str(mv.version),
            "registered_by": mv.tags.get(TAG_OWNER, "unknown"),
            "promoted": False,
            "champion_version": str(champ.version) if champ else None,
            "promotion": f"reused v{mv.version} (same checkpoint; was: {mv.tags[TAG_PROMOTION]})",
            "aliases": sorted(client.get_model_version(name, mv.version).aliases),
        }
    if mv is None:
        run = client.get_run(run_id)
        links = run_links(uri, run.info.experiment_id, run_id)
        description = describe(
            cfg,
            links=links,
            checkpoint=checkpoint,
            source=source,
            metrics=run.data.metrics,
            manifest=manifest,
            results=results,
            params=parameter_count(hf_dir) if hf_dir else None,
            lineage=lineage,
        )
        tags = {
            TAG_CHECKPOINT: checkpoint,
            TAG_OWNER: pipeline_user(cfg.tracking),
            "mode": cfg.diffusion.model_running_mode,
            "preset": cfg.name,
            **({TAG_DATA: manifest.hash} if manifest else {}),
            **({TAG_FILES: json.dumps(export_digests(hf_dir), sort_keys=True)} if hf_dir else {}),
            **{f"source.{k}": str(v) for k, v in (lineage or {}).items()},
        }
        mv = client.create_model_version(name, source=source, run_id=run_id, tags=tags, description=description)
    t = cfg.tracking
    return {
        **out,
        "version": str(mv.version),
        "registered_by": mv.tags.get(TAG_OWNER, "unknown"),
        **promote(client, name, mv.version, t.champion_metric, t.champion_higher_is_better),
    }


def parameter_count(hf_dir: Path) -> int | None:
    """Parameters in the export's safetensors files, read from their JSON headers (no tensors loaded)."""
    total, files = 0, sorted(Path(hf_dir).glob("*.safetensors"))
    try:
        for f in files:
            with open(f, "rb") as fh:
                header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
            for key, t in header.items():
                if key != "__metadata__":
                    n = 1
                    for d in t["shape"]:
                        n *= d
                    total += n
    except (OSError, ValueError, KeyError, struct.error):
        return None
    return total if files else None


# MLflow 3's UI opens in its GenAI view unless asked for the model-training one; links from us ask for it
TRAINING_VIEW = "workflowType=machine_learning"


def run_links(uri: str, experiment_id: str, run_id: str) -> dict[str, str]:
    """`runs:/<id>`, and the UI page of the run when the store is a server."""
    links = {"run": f"runs:/{run_id}"}
    if uri.startswith(("http://", "https://")):
        links["ui"] = f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{TRAINING_VIEW}"
    return links


def describe(
    cfg: PipelineConfig,
    *,
    links: dict[str, str],
    checkpoint: str,
    source: str,
    metrics: dict[str, float],
    manifest: DataManifest | None = None,
    results: dict | None = None,
    params: int | None = None,
    lineage: dict | None = None,
) -> str:
    """The version's markdown description: what was trained on what, how well it did, where it all lives."""
    m, t = cfg.model, cfg.train
    size = f"{m.num_layers} layers x {m.hidden_size} hidden, {m.num_attention_heads} heads"
    lines = [
        f"**{cfg.diffusion.model_running_mode}** LM, preset `{cfg.name}`: {size}"
        + (f", {params / 1e6:.2f}M parameters" if params else ""),
        "",
    ]
    if manifest:
        sources = ", ".join(s.get("name", "?") for s in manifest.sources) or "?"
        tokens = ", ".join(f"{k} {v.tokens:,}" for k, v in manifest.splits.items())
        lines.append(f"- data: `{manifest.hash}` from {sources}; tokens {tokens}")
    lines.append(
        f"- training: {t.train_iters} steps x {t.global_batch_size} x {t.seq_length} tokens"
        + (f"; final val_loss {metrics['val_loss']:.4f}" if "val_loss" in metrics else "")
    )
    if lineage:
        lines.append(f"- trained from: {lineage_line(lineage)}")
    bound = (results or {}).get("bounds", {}).get("trained")
    if bound:
        what = "ELBO (upper bound)" if bound.get("bound") else "exact NLL"
        lines.append(f"- validation {what}: {bound['nll_per_token']:.4f} nats/token, ppl {bound['ppl']:.1f}")
    for task, scores in (results or {}).get("tasks", {}).items():
        shown = ", ".join(
            f"{k} {v:.3f}" for k, v in scores.items() if isinstance(v, (int, float)) and k not in ("items", "chance")
        )
        lines.append(f"- task {task}: {shown} ({scores.get('items', '?')} items)")
    metric = cfg.tracking.champion_metric
    better = "higher" if cfg.tracking.champion_higher_is_better else "lower"
    value = f"{metrics[metric]:.4g}" if metric in metrics else "not logged"
    lines += [
        f"- champion metric `{metric}` ({better} is better): {value}",
        "",
        "Links:",
        f"- run: `{links['run']}`" + (f" ([MLflow UI]({links['ui']}))" if "ui" in links else ""),
    ]
    if manifest:
        lines.append(f"- dataset: `{links['run']}/data/manifest.json`, on disk `{manifest.dir}`")
    lines += [f"- checkpoint: `{checkpoint}`", f"- model files: `{source}`"]
    return "\n".join(lines)


def lineage_line(lineage: dict) -> str:
    """The source a model was trained from (adapt, sft), as its version's description names it: the pretrained
    run, its MLflow run and registered version where known, and the folder's sha256."""
    parts = [f"{what} `{lineage[k]}`" for k, what in LINEAGE_PARTS if lineage.get(k)]
    sha = str(lineage.get("sha256", ""))[:16]
    return ", ".join(parts) + (f" (sha256 {sha}...)" if sha else "")


LINEAGE_PARTS = (
    ("run_dir", "run"),
    ("mlflow_run_id", "MLflow run"),
    ("registered_version", "registered version"),
    ("path", "files"),
)
