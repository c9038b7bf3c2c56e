"""Prefect's cache, keyed by what already names each stage's output: the content-addressed folder (data
`<workdir>/data/<hash>`, run `<workdir>/runs/<mode>-<data hash>-<train hash>`, its export) and, for evaluation,
the hash of the eval settings and the checkpoint.

A cached stage is skipped by Prefect (state `Cached` in the UI) only while its output is still on disk: when the
folder is missing or incomplete, `refresh_cache` makes the stage run and rewrite the cache entry. So deleting a
folder reruns its stage and what depends on it, and wiping Prefect's state only costs a fast reuse run (each
stage function also reuses its finished folder on its own)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect.cache_policies import CacheKeyFnPolicy
from prefect.settings import get_current_settings

from difflm.config import FLAT_SAMPLER_FIELDS, PipelineConfig
from difflm.manifest import DataManifest
from difflm.rundir import EVAL_KEY, exported_from

EVAL_KEY_FILE = EVAL_KEY  # in the evaluation's output folder: the key its results were computed for


def cache_key(stage: str, *parts) -> str:
    """`stage`-sha256 of the parts (paths, hashes, settings), short enough for Prefect's key store."""
    blob = json.dumps([str(p) if isinstance(p, Path) else p for p in parts], sort_keys=True, default=str)
    return f"{stage}-{hashlib.sha256(blob.encode()).hexdigest()[:32]}"


# The one serializer our records are written with (run_stage's result_serializer="json"), field for field: Prefect
# decodes a stored record with whatever the record names (its object_decoder is called on every JSON object), so a
# record naming anything else could call any importable function.
OUR_SERIALIZER = {
    "type": "json",
    "jsonlib": "json",
    "object_encoder": "prefect.serializers.prefect_json_object_encoder",
    "object_decoder": "prefect.serializers.prefect_json_object_decoder",
    "dumps_kwargs": {},
    "loads_kwargs": {},
}
# the classes our stages return (TrainResult, ImportedSource, ...): Prefect's decoder imports and builds any class a
# record names, so a record naming another one is not ours
OUR_CLASSES = ("difflm.", "pathlib.")


def _classes(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        if isinstance(value.get("__class__"), str):
            yield value["__class__"]
        for v in value.values():
            yield from _classes(v)
    elif isinstance(value, list):
        for v in value:
            yield from _classes(v)


def is_our_record(blob: bytes) -> bool:
    """A stored result as run_stage writes it: exactly our JSON serializer, naming only our own classes (read with
    the plain json module: nothing named in it is imported or called here)."""
    try:
        record = json.loads(blob)
        if record["metadata"]["serializer"] != OUR_SERIALIZER:
            return False
        return all(name.startswith(OUR_CLASSES) for name in _classes(json.loads(record["result"])))
    except (ValueError, KeyError, TypeError):
        return False


def drop_foreign_record(key: str) -> bool:
    """Remove the stored result of `key` unless it is one of ours (`is_our_record`): a record planted in the
    (shared) workdir naming `pickle`, another decoder or another class would run its code when read. Removing it
    only costs running the stage again (which reuses its finished output). Returns whether one was removed."""
    path = Path(get_current_settings().results.local_storage_path) / key
    if not path.is_file() or is_our_record(path.read_bytes()):
        return False
    path.unlink(missing_ok=True)
    return True


def run_stage(task, key: str, done: bool, *args, **kwargs):
    """Run `task` under the cache `key`: (result, cached). `done`: the stage's output is complete on disk (a
    cache hit is allowed); otherwise the stage runs whatever the cache holds."""
    drop_foreign_record(key)
    state = task.with_options(
        cache_policy=CacheKeyFnPolicy(cache_key_fn=lambda *_: key),
        refresh_cache=not done,
        persist_result=True,
        # JSON, not Prefect's default pickle: the stored results live in the (shared) workdir, and a pickle
        # there would run whatever a writer of that folder put in it when the cache is read
        result_serializer="json",
    )(*args, return_state=True, **kwargs)
    return state.result(), state.name == "Cached"


def eval_key(cfg: PipelineConfig, manifest: DataManifest, hf_dir: str | Path) -> str:
    """What an evaluation result depends on: the eval settings, the data and the exported checkpoint."""
    source = exported_from(Path(hf_dir)) or str(hf_dir)
    return cache_key("evaluate", _eval_settings(cfg), manifest.hash, source, str(hf_dir))


# eval settings added with the evaluation record (issue 47), left out of the key at their defaults: the results an
# older release computed are still found (its record lacks the new sections; `difflm eval --force` writes them)
RECORD_FIELDS = {
    "threshold_sweep": [],
    "gen_length": 8,
    "speed_batch": 8,
    "speed_repeats": 5,
    "baseline": None,
    "instruction_items": 64,  # issue 49: read by SFT's evaluation only
}


def _eval_settings(cfg: PipelineConfig) -> dict:
    """eval.* as keyed before eval.sampler existed (its fields flat, sampler_steps for steps): the results a
    run's pipeline computed then are still found, not computed again."""
    settings = cfg.eval.model_dump(mode="json")
    sampler = settings.pop("sampler")
    for name, default in RECORD_FIELDS.items():
        if settings.get(name) == default:
            settings.pop(name)
    return {**settings, **{old: sampler[new] for old, new in FLAT_SAMPLER_FIELDS.items()}}


def eval_done(out_dir: Path, key: str) -> bool:
    f = Path(out_dir) / EVAL_KEY_FILE
    return (Path(out_dir) / "results.json").exists() and f.exists() and f.read_text().strip() == key


def mark_eval_done(out_dir: Path, key: str) -> None:
    (Path(out_dir) / EVAL_KEY_FILE).write_text(key + "\n")
