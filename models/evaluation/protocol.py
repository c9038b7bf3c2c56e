"""What an evaluation was, beside what it scored: the model's identity, each task's protocol, the decoding fixed
before scoring, and the software it ran on. These sections of the evaluation record (record.py) are what a
second evaluation must match to count as a reproduction (`fingerprint`), and what `differences` names when it
does not.

Digests are SHA-256 of file contents, so a copied export has the same identity, and a retrained one does not.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from difflm.models.diffusion import MaskedSampler
from difflm.models.diffusion.modes import objective_class
from difflm.rundir import exported_from

WEIGHTS = ("model.safetensors", "pytorch_model.bin")
CONFIG = ("config.json",)
TOKENIZER = ("tokenizer.json", "tokenizer_config.json")
TASK_SUITE = "difflm-heldout/1"  # the built-in tasks' definition (tasks.py): bump when items or scoring change


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_json(value: Any) -> str:
    """The digest of a JSON value, keys sorted: the same settings give the same digest wherever written."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def files_digest(folder: Path, names: tuple[str, ...]) -> str | None:
    found = [folder / n for n in names if (folder / n).is_file()]
    if not found:
        return None
    return sha256_json({p.name: sha256_file(p) for p in found})


def model_identity(model, hf_dir: Path) -> dict[str, Any]:
    """The scored model: weight and tokenizer digests, the checkpoint it was exported from, its objective and
    settings, mask id and block size."""
    cfg = model.config
    objective = model.objective
    settings = {k: v for k, v in dataclasses.asdict(objective).items() if _plain(v)}
    return {
        "weights_sha256": files_digest(Path(hf_dir), WEIGHTS),
        "config_sha256": files_digest(Path(hf_dir), CONFIG),  # the same weights under another mode differ here
        "tokenizer_sha256": files_digest(Path(hf_dir), TOKENIZER),
        "checkpoint": exported_from(
            Path(hf_dir)
        ),  # None: not written from a checkpoint (a stock folder, a random init)
        "mode": cfg.model_running_mode,
        "objective": settings,
        "mask_id": cfg.mask_token_id,
        "eos_id": cfg.eos_token_id,
        "block_size": getattr(objective, "block_size", None),
        "parameters": sum(p.numel() for p in model.parameters()),
        "max_length": int(cfg.max_position_embeddings),
    }


def _plain(v: Any) -> bool:
    return (
        v is None
        or isinstance(v, (bool, int, float, str))
        or (isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float, str)) for x in v))
    )


def decoding(settings: MaskedSampler, new_tokens: int, seed: int, mode: str, block_size: int | None) -> dict:
    """The decoding every generation of the evaluation used, fixed before any score was computed."""
    return {
        **dataclasses.asdict(settings),
        "gen_length": new_tokens,
        "confidence_rule": settings.remasking,
        "eos_rule": "stop at the first EOS with nothing masked before it" if settings.stop_at_eos else "none",
        "model_block_size": block_size,
        "decoder": decoder_name(mode, block_size),
        "seed": seed,
    }


def decoder_name(mode: str, block_size: int | None) -> str:
    """How a mode's model decodes, for the record: left to right with its cache, block by block, or all at once."""
    if left_to_right(mode):
        return "left to right + KV cache"
    return "block diffusion" if block_size else "diffusion (iterative denoising)"


def left_to_right(mode: str) -> bool | None:
    """Whether the mode decodes token by token (the AR rows of a comparison); None for a mode this version does not
    know (a record written by another one)."""
    try:
        return not objective_class(mode).bidirectional
    except (KeyError, ValueError):
        return None


def task_protocol(name: str, items: list[dict], lm_eval_yaml: dict | None, scorer: str, **extra: Any) -> dict:
    """One task's protocol: the suite and lm-eval versions, the task config's and the items' digests, split,
    shots, and the scorer (`extra`: stop sequences, answer filters)."""
    config = dict(lm_eval_yaml or {})
    config.pop("dataset_kwargs", None)  # the items' path on this machine: their digest stands for them
    return {
        "suite": TASK_SUITE,
        "lm_eval": _version("lm_eval"),
        "config_sha256": sha256_json(config) if config else None,
        "data_sha256": sha256_json(items),
        "split": "valid (the held-out split of the data manifest)",
        "shots": 0,
        "items": len(items),
        "scorer": scorer,
        **extra,
    }


def environment() -> dict[str, Any]:
    """Software and machine: versions that change scores or speed, the code's commit, when."""
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "difflm": _version("difflm-pipeline"),
        "commit": commit or None,
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "lm_eval": _version("lm_eval"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "host": platform.node(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# ---- what makes two evaluations the same evaluation --------------------------------------------------------

# (section, keys): settings that must match for a reproduction; None: the whole section
REPRODUCED_BY = {
    "model": ("weights_sha256", "config_sha256", "tokenizer_sha256", "mode", "objective", "mask_id", "block_size"),
    "decoding": None,
    "task_settings": None,
    "data_hash": None,
    "dtype": None,
}


def settings_of(record) -> dict[str, Any]:
    """The flat settings of a record that define its evaluation: `section.key` -> value (task protocols by their
    config and data digests)."""
    flat: dict[str, Any] = {}
    for section, keys in REPRODUCED_BY.items():
        value = getattr(record, section, None)
        if isinstance(value, dict):
            for k, v in value.items():
                if keys is None or k in keys:
                    flat[f"{section}.{k}"] = v
        else:
            flat[section] = value
    for task, scores in (record.tasks or {}).items():
        proto = scores.get("protocol") or {}
        for k in ("config_sha256", "data_sha256", "shots", "suite"):
            if k in proto:
                flat[f"tasks.{task}.{k}"] = proto[k]
    return flat


def differences(a, b) -> list[str]:
    """What differs between two records' settings, as 'key: a -> b' (empty: the same evaluation)."""
    x, y = settings_of(a), settings_of(b)
    return [
        f"{k}: {_short(x.get(k))} -> {_short(y.get(k))}" for k in sorted(x.keys() | y.keys()) if x.get(k) != y.get(k)
    ]


def fingerprint(record) -> str:
    return sha256_json(settings_of(record))


def _short(v: Any) -> str:
    s = json.dumps(v, sort_keys=True, default=str) if not isinstance(v, str) else v
    return s if len(s) <= 24 else s[:12] + "..."
