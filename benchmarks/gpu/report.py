"""The check's report and section runner: report.json and report.md rewritten at the start and end of every
section and whenever a worker writes a row (a killed run leaves every finished section's figures), one JSON line
per section on stdout, the time budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from benchmarks.gpu.figures import GOAL_MFU_1B, summary
from benchmarks.gpu.runtime import Interrupted, SectionFailed, read_jsonl

MICROBATCH_JOBS = ("microbatch-1b", "long-context", "profile-350m")


class Check:
    """The report (rewritten after every change), the time budget and the section runner."""

    def __init__(
        self, out: Path, p: dict, budget_s: float, meta: dict, only: set[str] | None = None, always=frozenset()
    ):
        self.out, self.p, self.budget_s, self.only, self.always = out, p, budget_s, only, set(always)
        self.started = time.time()
        self.cap_s = float("inf")  # the running section's own time cap
        self.report = {**meta, "plan": p, "environment": {}, "sections": {}, "seconds": 0.0}
        self.sections = self.report["sections"]

    def left(self) -> float:
        return self.budget_s - (time.time() - self.started)

    def timeout(self) -> float:
        """A child's timeout: the plan's, cut to the running section's cap on a GPU and to the budget left (the
        copy-back after an outer timeout needs the check to end on its own)."""
        cap = self.p["timeout"] if self.p["dry"] else min(self.p["timeout"], self.cap_s)
        return max(10.0, min(cap, self.left()))

    def write(self) -> None:
        self.report["seconds"] = time.time() - self.started
        for name, text in (
            ("report.json", json.dumps(self.report, indent=1, default=str)),
            ("report.md", markdown(self.report)),
        ):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.out / name)  # a reader (or a kill) never sees half a report

    def emit(self, line: dict) -> None:
        print(json.dumps(line, default=str), flush=True)

    def rows(self, name: str, path: Path, summarise=None):
        """A poll callback: new rows of `path` go into the section's partial result, the report and stdout."""
        seen = [0]

        def poll():
            rows = read_jsonl(path)
            if len(rows) == seen[0]:
                return
            self.sections[name]["partial"] = summarise(rows) if summarise else {"rows": rows}
            self.write()  # the report first: a row on stdout is already in the report
            for row in rows[seen[0] :]:
                self.emit({"section": name, "row": row})
            seen[0] = len(rows)

        return poll

    def skip(self, name: str, why: str) -> None:
        self.sections[name] = {"status": why, "seconds": 0.0}
        self.write()
        self.emit({"section": name, "status": "skipped", "seconds": 0.0, "why": why})

    def section(self, name: str, fn, need_s: float = 0, cap_s: float = float("inf")):
        if self.only and name not in self.only | self.always:
            self.skip(name, "skipped: not in --only")
            return None
        left = self.left()
        if left < need_s:
            self.skip(name, f"skipped: {left:.0f} s of the time budget left")
            return None
        tic = time.time()
        self.cap_s = cap_s
        entry = self.sections[name] = {"status": "running", "seconds": 0.0}
        self.write()
        print(f"[gpu-check] {name} ...", file=sys.stderr, flush=True)
        result = None
        try:
            result = fn()
            entry.update(status="ok", result=result)
            entry.pop("partial", None)
        except Interrupted:
            entry.update(status="killed", seconds=time.time() - tic)
            self.write()
            self.emit(
                {"section": name, "status": "killed", "seconds": entry["seconds"], "result": entry.get("partial")}
            )
            raise
        except SectionFailed as exc:
            entry.update(status="failed", error=str(exc), partial=exc.partial)
        except subprocess.TimeoutExpired as exc:  # its child ran out of time (plan or budget): rows kept
            entry.update(status="timeout", error=f"{exc}")
        except (Exception, SystemExit):  # a failed section is reported; the others still run
            entry.update(status="failed", error=traceback.format_exc())
        entry["seconds"] = time.time() - tic
        self.write()
        self.emit(
            {
                "section": name,
                "status": entry["status"],
                "seconds": round(entry["seconds"], 2),
                "result": result if result is not None else entry.get("partial"),
                **({"error": entry["error"][-600:]} if "error" in entry else {}),
            }
        )
        return result


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def _table(keys: list[str], rows: list[dict]) -> list[str]:
    return [
        "| " + " | ".join(keys) + " |",
        "|" + "---|" * len(keys),
        *["| " + " | ".join(_fmt(r.get(k)) for k in keys) + " |" for r in rows],
    ]


def markdown(report: dict) -> str:
    env = report.get("environment") or {}
    lines = [
        f"# GPU check ({'dry run, CPU' if report['dry_run'] else env.get('device', 'GPU')})",
        "",
        f"torch {env.get('torch')} (CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}), megatron-core "
        f"{env.get('megatron_core')}, Transformer Engine: {'yes' if env.get('transformer_engine') else 'no'}; "
        f"from the wheels: {', '.join(env.get('installed_from_wheels') or []) or '-'}; SDPA forced: "
        f"{report.get('sdpa_forced') or 'no'}; {report['seconds']:.0f} s so far. MFU is against the datasheet "
        f"dense bf16 peak (models/megatron/flops.py).",
        "",
        "| section | status | seconds |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {s['status']} | {s['seconds']:.1f} |" for name, s in report["sections"].items()]
    for name, s in report["sections"].items():
        lines += ["", f"## {name}", ""]
        if s["status"] == "ok":
            lines += _section_lines(name, s["result"])
            continue
        if s.get("partial"):
            lines += [f"Figures so far ({s['status']}):", ""] + _section_lines(name, s["partial"]) + [""]
        if s.get("error") or s["status"] != "running":
            lines += ["```", s.get("error", s["status"])[-3000:], "```"]
    return "\n".join(lines) + "\n"


def _section_lines(name: str, r: dict) -> list[str]:
    if name.startswith("train-") and name != "train-block":
        keys = ["mode", "preset", "seq", "micro_batch", "block_size", "complementary_masks", "steps", "steps_logged"]
        keys += ["tokens_per_s_per_device", "tflops_per_device", "mfu", "peak_memory_gb", "loss_first", "loss_last"]
        keys += ["val_last", "loss_falling"]
        return _table(keys, r.get("rows", [r]))
    if name == "train-block":
        return _section_lines("train-", {"rows": list(r.values())} if "block" in r else r)
    if name == "mfu-knobs" and "rows" in r:
        rows = [x for x in r["rows"] if "knob" in x]
        return [
            "Each lever against off at its shape and preset (model.compile, model.recompute, model.cuda_graphs):",
            "",
            *_table(["knob", "preset", *ROW_KEYS], rows),
        ]
    if name == "decode" and "rows" in r:
        keys = ["model", "mode", "batch_size", "sampler", "tokens_per_s", "speedup", "model_calls_per_token"]
        keys += ["agreement", "dominant_share", "peak_memory_gb"]
        lines = [
            "Speed-up: tokens/s over one-token-per-step of the same model kind and batch size; agreement: the share "
            "of tokens equal to that row's; dominant_share: generated pairs that follow the chain's dominant "
            f"successor. Goal (confident model, equal output, 3x): `{json.dumps(r.get('goal'))}`.",
            "",
            *_table(keys, r["rows"]),
        ]
        return lines + (
            ["", f"Errors (training by mode, decoding): `{json.dumps(r['errors'])}`."] if r.get("errors") else []
        )
    if name in MICROBATCH_JOBS and "rows" in r:
        return _microbatch_lines(name, r if "largest_micro_batch" in r else summary(name, {}, r["rows"]))
    if name == "probe":
        lines = []
        att = r.get("attention") or {}
        keys = ["layout", "chosen", "default_ms", "flash_ms", "cudnn_ms", "efficient_ms", "math_ms", "errors"]
        if att:
            rows = [
                {
                    "layout": k,
                    **v,
                    "errors": "; ".join(f"{e[:-6]}: {t[:80]}" for e, t in v.items() if e.endswith("_error")) or None,
                }
                for k, v in att.items()
            ]
            lines += _table(keys, rows) + [""]
        rest = {k: v for k, v in r.items() if k != "attention"}
        return lines + ["```json", json.dumps(rest, indent=1, default=str), "```"]
    return ["```json", json.dumps(r, indent=1, default=str), "```"]


ROW_KEYS = ["mode", "seq", "micro_batch", "repeat", "step_s", "step_min_s", "step_max_s", "forward_backward_s"]
ROW_KEYS += ["tokens_per_s", "tflops", "mfu", "mfu_megatron", "pairs_share", "peak_memory_gb", "oom", "error"]


def _microbatch_lines(name: str, r: dict) -> list[str]:
    goal = f" (goal {GOAL_MFU_1B})" if name == "microbatch-1b" else ""
    lines = [
        f"Headline: seq {r['seq']}, micro-batch {r['largest_micro_batch']}: MFU {_fmt(r['mfu'])}{goal}, "
        f"{_fmt(r.get('mfu_megatron'))} by Megatron-LM's formula (attention always halved), repeat "
        f"{_fmt(r.get('repeat_mfu'))}; {_fmt(r.get('mfu_without_optimizer'))} without the optimizer step (the same "
        f"unprofiled steps' forward+backward); {r.get('baseline_mode') or 'baseline'} at that shape "
        f"{_fmt(r.get('baseline_mfu'))}, TFLOP/s ratio {_fmt(r.get('over_baseline_tflops'))} (step time "
        f"{_fmt(r.get('over_baseline_step_time'))}: bidirectional attention does 2x the attention FLOPs). Step "
        "times: the median of the timed steps, with their min and max.",
        "",
        *_table(ROW_KEYS, r["rows"]),
    ]
    if r.get("kernels"):
        lines += ["", f"Kernels: `{json.dumps(r['kernels'])}`."]
    for prof in r.get("profiles") or []:
        if "share" not in prof:
            lines += ["", f"Profile at micro-batch {prof.get('micro_batch')}: {prof.get('error')}"]
            continue
        lines += [
            "",
            f"Profiled step, {prof.get('mode')} seq {prof.get('seq')} micro-batch {prof.get('micro_batch')} "
            f"({prof['timed']}): forward+backward {prof['forward_backward_ms']:.1f} ms, optimizer "
            f"{prof['optimizer_ms']:.1f} ms (profiled {prof['profiled_step_ms']:.1f} ms, unprofiled "
            f"{_fmt(prof.get('unprofiled_step_ms'))} ms); device busy {_fmt(prof.get('busy_share'))} of the "
            f"unprofiled step; attention kernels: {', '.join(prof.get('attention_kernels') or []) or '-'}.",
            "",
        ]
        cats = sorted(prof["share"])
        lines += _table(
            ["category", *cats],
            [{"category": "ms", **prof["kernel_ms"]}, {"category": "share", **prof["share"]}],
        )
        top = prof.get("top_elementwise") or []
        if top:
            lines += ["", "Heaviest elementwise kernels (ms): " + "; ".join(f"`{k}` {v}" for k, v in top) + "."]
    return lines
