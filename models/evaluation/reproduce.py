"""`difflm eval --reproduce RECORD` and `difflm compare RECORD...`: an evaluation record checked against a rerun, and
records side by side.

Reproduction: the record's model (its export, whose weight digest must still match), its data and every setting
it recorded (decoding, task items, Monte-Carlo draws, seed, dtype, windows) are evaluated again into a folder of
their own; each score is then within its standard error of the recorded one, or it is not, one line each, and
what differs in the settings is named (protocol.differences).

Comparison: one point per decoding setting of each record (its own decoding, its sweep's rows, its AR baseline
row) in a table and a picture of accuracy against TPF and against tokens/s. tokens/s compare only on one machine:
records from different hosts or devices are compared by TPF, NFE and AUP alone, and the table says so.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from difflm.errors import UserError
from difflm.models.evaluation.protocol import CONFIG, WEIGHTS, differences, files_digest, left_to_right
from difflm.models.evaluation.record import EvalRecord, placement_label
from difflm.tracking.plots import plot_parallelism


class ReproduceError(UserError, ValueError):
    """A record that cannot be rerun as recorded (its export is gone or changed); the message says what to do."""


# ---- reproduce ---------------------------------------------------------------------------------------------


def rerun_overrides(record: EvalRecord) -> list[str]:
    """`section.field=value` overrides that set a config to the record's own evaluation settings."""
    if record.decoding is None:
        raise ReproduceError(
            f"the record of {record.export} has no decoding settings (written before evaluation records held "
            "them): evaluate the export again (difflm eval) and reproduce that record"
        )
    out = []
    d = record.decoding
    for key in ("steps", "block_length", "remasking", "threshold", "eps", "temperature", "top_k", "top_p", "cfg_scale",
                "stop_at_eos", "prefix_cache", "kv_cache"):  # fmt: skip
        if key in d:
            out.append(f"eval.sampler.{key}={_yaml(d[key])}")
    out.append(f"eval.gen_length={d['gen_length']}")
    out.append(f"eval.seed={d['seed']}")
    ts = record.task_settings or {}
    out += [f"eval.task_items={ts['items']}", f"eval.mc_samples={ts['mc_samples']}"] if ts else []
    bound = record.bounds.get("trained", {})
    if bound.get("mc_samples"):
        out.append(f"eval.t_samples={bound['mc_samples']}")
    if bound.get("sequences"):
        out.append(f"eval.max_sequences={bound['sequences']}")
    if record.dtype:
        out.append(f"eval.dtype={record.dtype}")
    eff = record.efficiency or {}
    if eff.get("batch_size"):
        out.append(f"eval.speed_batch={eff['batch_size']}")
    return out


def _yaml(v: Any) -> str:
    return "null" if v is None else json.dumps(v) if isinstance(v, (bool, str)) else str(v)


def check_export(record: EvalRecord) -> Path:
    """The record's export folder, still holding the weights the record scored."""
    folder = Path(record.export)
    if not (folder / "config.json").is_file():
        raise ReproduceError(
            f"the record's export {folder} is gone: export the run again (difflm convert) at that path, or "
            "reproduce a record of an export that exists"
        )
    want = (record.model or {}).get("weights_sha256")
    have = files_digest(folder, WEIGHTS)
    config_changed = (record.model or {}).get("config_sha256") not in (None, files_digest(folder, CONFIG))
    if (want and have != want) or config_changed:
        raise ReproduceError(
            f"{folder} no longer holds the weights the record scored (sha256 {have[:12] if have else None}... "
            f"!= {want[:12]}...): it was exported again from another checkpoint; reproduce a newer record"
        )
    return folder


def scores(record: EvalRecord) -> dict[str, tuple[float, float | None]]:
    """name -> (value, standard error) of every score with a standard error, and the hardware-independent
    decoding counters (NFE, TPF: exact under greedy decoding, so their 'error' is 0)."""
    out: dict[str, tuple[float, float | None]] = {}
    b = record.bounds.get("trained", {})
    out["bound nats/token"] = (b["nll_per_token"], b.get("stderr"))
    for task, s in (record.tasks or {}).items():
        for key, value in s.items():
            if f"{key}_stderr" in s and isinstance(value, (int, float)) and value is not None:
                out[f"{task} {key}"] = (float(value), s[f"{key}_stderr"])
    eff = record.efficiency or {}
    for key in ("nfe", "tpf"):
        if eff.get(key) is not None:
            out[key] = (float(eff[key]), 0.0 if (record.decoding or {}).get("temperature", 0) == 0 else None)
    return out


def reproduction(old: EvalRecord, new: EvalRecord) -> tuple[bool, list[str]]:
    """(every score within its standard error, one line per score and per differing setting)."""
    lines, ok = [], True
    a, b = scores(old), scores(new)
    for name in sorted(a.keys() & b.keys()):
        (x, se_x), (y, se_y) = a[name], b[name]
        se = math.hypot(se_x or 0.0, se_y or 0.0)
        within = abs(y - x) <= se + 1e-9 * max(1.0, abs(x))
        ok &= within
        word = "reproduced" if within else "NOT reproduced"
        lines.append(f"{word}: {name} {x:.4g} -> {y:.4g} (|diff| {abs(y - x):.3g}, standard error {se:.3g})")
    for name in sorted(a.keys() - b.keys()):
        ok = False
        lines.append(f"NOT reproduced: {name} {a[name][0]:.4g} -> not measured")
    changed = differences(old, new)
    if changed:
        lines.append("settings that differ: " + "; ".join(changed))
    old_speed, new_speed = (old.efficiency or {}), (new.efficiency or {})
    if old_speed.get("tokens_per_s_batch1") and new_speed.get("tokens_per_s_batch1"):
        lines.append(
            f"(tokens/s at batch 1: {old_speed['tokens_per_s_batch1']:.1f} on {_where(old)} -> "
            f"{new_speed['tokens_per_s_batch1']:.1f} on {_where(new)}: hardware-dependent, not judged)"
        )
    return ok, lines


def _where(r: EvalRecord) -> str:
    return f"{(r.environment or {}).get('host', '?')} {placement_label(r.device, r.dtype, r.device_name)}"


# ---- compare -----------------------------------------------------------------------------------------------


def read_records(paths: list[str]) -> list[tuple[str, EvalRecord]]:
    """(name, record) of each results.json (or folder holding one): named by its run (<run>/eval -> <run>)."""
    out = []
    for p in paths:
        path = Path(p)
        record = EvalRecord.read(path)
        folder = path if path.is_dir() else path.parent
        name = folder.parent.name if folder.name.startswith("eval") else folder.name
        while name in dict(out):
            name += "'"
        out.append((name, record))
    return out


def points(name: str, record: EvalRecord) -> list[dict]:
    """One point per decoding setting: the record's own decoding, each sweep row, its AR baseline row."""
    gen = (record.tasks or {}).get("cloze_gen") or {}
    eff = record.efficiency or {}
    d = record.decoding or {}
    own = "threshold {}".format(d["threshold"]) if d.get("threshold") is not None else f"steps {d.get('steps')}"
    pts = [
        {
            "record": name,
            "label": f"{name} {own}",
            "mode": record.mode,
            "accuracy": gen.get("exact_match_flexible"),
            "nfe": eff.get("nfe"),
            "tpf": eff.get("tpf"),
            "tokens_per_s": eff.get("tokens_per_s_batch1"),
            "aup": (record.aup or {}).get("value"),
            "ar": bool(left_to_right(record.mode)),
        }
    ]
    for row in record.sweep or []:
        pts.append(
            {
                "record": name,
                "label": f"{name} {row.get('setting', 'steps ' + str(row['steps']))}",
                "mode": record.mode,
                "accuracy": row.get("accuracy"),
                "nfe": row.get("nfe"),
                "tpf": row.get("tpf"),
                "tokens_per_s": row.get("tokens_per_s"),
                "aup": None,
                "ar": bool(left_to_right(record.mode)),
            }
        )
    if record.baseline:
        b = record.baseline
        pts.append(
            {
                "record": name,
                "label": f"{name} AR baseline",
                "mode": b.get("mode", "ar"),
                "accuracy": b.get("exact_match_flexible"),
                "nfe": b.get("nfe"),
                "tpf": b.get("tpf"),
                "tokens_per_s": b.get("tokens_per_s_batch1"),
                "aup": None,
                "ar": True,
            }
        )
    return pts


def machines(records: list[tuple[str, EvalRecord]]) -> set[str]:
    return {_where(r) for _, r in records}


def compare(records: list[tuple[str, EvalRecord]], out_dir: Path) -> dict[str, Path]:
    """compare.md (the table), compare.json (the points) and compare.png in out_dir."""
    same = len(machines(records)) == 1
    pts = [p for name, r in records for p in points(name, r)]
    out_dir.mkdir(parents=True, exist_ok=True)
    head = ["setting", "mode", "exact match", "NFE", "TPF"] + (["tokens/s (batch 1)"] if same else []) + ["AUP"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in pts:
        cells = [
            p["label"] + (" (AR)" if p["ar"] else ""),
            p["mode"],
            _fmt(p["accuracy"], "{:.3f}"),
            _fmt(p["nfe"], "{:.0f}"),
            _fmt(p["tpf"], "{:.2f}"),
        ]
        cells += [_fmt(p["tokens_per_s"], "{:.1f}")] if same else []
        cells += [_fmt(p["aup"], "{:.1f}")]
        lines.append("| " + " | ".join(cells) + " |")
    where = sorted(machines(records))
    note = (
        f"All on one machine ({where[0]}): tokens/s compare."
        if same
        else "Records from different machines (" + "; ".join(where) + "): compared by TPF, NFE and AUP only, "
        "which do not depend on the hardware; tokens/s are left out."
    )
    md = out_dir / "compare.md"
    md.write_text("# Evaluation records compared\n\n" + "\n".join(lines) + f"\n\n{note}\n")
    js = out_dir / "compare.json"
    js.write_text(json.dumps({"same_machine": same, "machines": where, "points": pts}, indent=2))
    png = plot_parallelism(
        [{**p, "tokens_per_s": p["tokens_per_s"] if same else None} for p in pts],
        out_dir / "compare.png",
        "accuracy against parallelism" + ("" if same else " (different machines: TPF only)"),
        speed=same,
    )
    return {"table": md, "points": js, **({"picture": png} if png else {})}


def _fmt(v: Any, f: str) -> str:
    return "-" if v is None else f.format(v)
