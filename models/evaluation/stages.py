"""Plain-function stages after training: export and evaluate (Prefect tasks wrap these)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from difflm.config import EvalConfig, PipelineConfig
from difflm.errors import UserError
from difflm.manifest import DataManifest
from difflm.models.diffusion.modes import build_objective, objective_class
from difflm.models.evaluation.efficiency import decode_counts, speed
from difflm.models.evaluation.generation import default_prompts, generate_samples, sampler_settings
from difflm.models.evaluation.likelihood import instruction_windows, likelihood_bound, validation_windows
from difflm.models.evaluation.progress import Progress
from difflm.models.evaluation.protocol import (
    CONFIG,
    WEIGHTS,
    decoding,
    environment,
    files_digest,
    model_identity,
    task_protocol,
)
from difflm.models.evaluation.record import RESULTS, EvalRecord, EvalRecordError
from difflm.models.evaluation.report import write_comparison
from difflm.models.evaluation.scoring import Scorer
from difflm.models.evaluation.sources import resolve_export
from difflm.models.evaluation.sweep import FILTERS, STOP, score_generation, sweep_aup, sweep_steps
from difflm.models.evaluation.tasks import (
    SCORER_NAMES,
    build_items,
    heldout_documents,
    lm_eval_task_config,
    score_tasks,
    write_lm_eval_tasks,
)
from difflm.models.hf.architectures import stock_problem
from difflm.models.hf.convert import ConversionError, export_hf
from difflm.models.hf.export import Export
from difflm.models.hf.importer import export_stock
from difflm.models.hf.modeling_difflm import DiffLMForMaskedLM
from difflm.rundir import EVAL_KEY, RunDir, TrainResult, Workdir, is_export_of
from difflm.tracking import tracking_uri
from difflm.tracking.plots import plot_sweep


def convert_checkpoint(cfg: PipelineConfig, manifest: DataManifest, trained: TrainResult) -> Export:
    """The HF export of the run's final checkpoint (reused when it was exported from that checkpoint)."""
    out = trained.run.hf
    if is_export_of(out, trained.checkpoint):
        return Export.read(out)
    provenance = {"data_hash": manifest.hash, "mode": cfg.diffusion.model_running_mode}
    export_stock_class(cfg, manifest, trained)
    return export_hf(cfg, manifest.tokenizer.to_dict(), trained.checkpoint, out, provenance)


def export_stock_class(cfg: PipelineConfig, manifest: DataManifest, trained: TrainResult) -> Export | None:
    """An `ar` run's final checkpoint also as the stock transformers class (<run>/hf-stock: Llama, or the class
    it was imported from), which `AutoModelForCausalLM.from_pretrained` and lm-eval's `hf` model load with no
    remote code; None for a diffusion model or a model no stock class computes (LayerNorm, GELU)."""
    if build_objective(cfg.diffusion).bidirectional or stock_problem(cfg.model):
        return None
    out, ckpt = trained.run.hf_stock, trained.checkpoint
    if is_export_of(out, ckpt):
        return Export.read(out)
    try:
        return export_stock(cfg, manifest.tokenizer.to_dict(), ckpt, out, {"data_hash": manifest.hash})
    except ConversionError as err:  # the run's own export (hf/) and evaluation do not depend on this one
        print(f"[convert] {out.name} not written: {err}", flush=True)
        return None


class EvaluationError(UserError, ValueError):
    """Evaluation cannot run as configured (another tokenizer's data, a GPU this machine lacks); the message
    says what to pass instead."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(
    device: str = "auto", dtype: str = "auto", setting: str = "eval."
) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) to evaluate on, from eval.device and eval.dtype: auto is CUDA when torch sees a GPU,
    else the CPU; dtype auto is bfloat16 on CUDA, float32 on the CPU. EvaluationError for a GPU that this
    machine does not have: raised when a model is loaded, so one config serves GPU and CPU machines alike.
    `setting` is how the messages name the two settings (`eval.` in a config, `model_args ` in lm-eval)."""
    if dtype != "auto" and dtype not in DTYPES:
        raise EvaluationError(f"{setting}dtype must be auto, {', '.join(DTYPES)}, not {dtype!r}")
    has_cuda = torch.cuda.is_available()
    dev = torch.device(("cuda" if has_cuda else "cpu") if device == "auto" else device)
    if dev.type == "cuda" and not has_cuda:
        why = (
            "this torch build has no CUDA (a CPU wheel)"
            if torch.version.cuda is None
            else "torch sees no GPU (driver, CUDA_VISIBLE_DEVICES?)"
        )
        raise EvaluationError(
            f"{setting}device={device}, but {why}: set {setting}device=auto (the GPU when "
            f"there is one, else the CPU) or {setting}device=cpu"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise EvaluationError(
            f"{setting}device={device}, but torch sees {torch.cuda.device_count()} GPU(s): "
            f"set {setting}device=cuda (the current one) or cuda:<index below the count>"
        )
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, DTYPES[dtype]


def eval_device(e: EvalConfig) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) of the config's evaluation (see `resolve_device`)."""
    return resolve_device(e.device, e.dtype)


def load_model(folder: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """An export with this project's model class (same weights and config as the folder's own code, which
    users load with trust_remote_code), in `dtype` on `device`: exports written by older versions gain
    today's helpers. The defaults are the CPU in float32; evaluation passes `eval_device(cfg.eval)`."""
    hf_logging.disable_progress_bar()  # one bar per load is noise in eval tables and logs
    # cast while loading (as LLaDA/Dream users pass torch_dtype): a large model is never built in fp32 on the host
    model = DiffLMForMaskedLM.from_pretrained(str(folder), local_files_only=True, dtype=dtype)
    return model.to(device).eval()


def placement(model) -> dict[str, str]:
    """{device, dtype, device_name} the model runs with: what produced a score, for results and tracking."""
    p = next(model.parameters())
    name = torch.cuda.get_device_name(p.device) if p.device.type == "cuda" else "cpu"
    return {"device": str(p.device), "dtype": str(p.dtype).removeprefix("torch."), "device_name": name}


def load_tokenizer(folder: Path):
    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def check_tokenizer(model, manifest: DataManifest, hf_dir: Path) -> None:
    tok = manifest.tokenizer
    if model.config.real_vocab_size != tok.vocab_size or model.config.mask_token_id != tok.mask_id:
        raise EvaluationError(
            f"{hf_dir} was trained with another tokenizer (vocab {model.config.real_vocab_size}, mask id "
            f"{model.config.mask_token_id}) than this config's data (vocab {tok.vocab_size}, mask id "
            f"{tok.mask_id}): evaluate it on its run's own data (no --preset: the run's config.yaml), or read "
            f"other data through its tokenizer (tokenizer.path={hf_dir})"
        )


def evaluate_export(
    cfg: PipelineConfig,
    manifest: DataManifest,
    hf_dir: Path,
    out_dir: Path | None = None,
    untrained: bool = True,
    echo: Callable[[str], None] | None = None,
) -> EvalRecord:
    """Likelihood bound of the trained (and an untrained, freshly initialised) model, the tasks built from
    the held-out split, and samples; written to `out_dir` (default: `default_out_dir`) with the lm-eval task
    files of the same items, and the comparison report of every run on the same data updated. `echo`: one line
    per part with its time (on 2 CPU cores the whole takes minutes; it used to be silent)."""
    e = cfg.eval
    device, dtype = eval_device(e)
    model, tok = load_model(hf_dir, device, dtype), load_tokenizer(hf_dir)
    check_tokenizer(model, manifest, hf_dir)
    windows = validation_windows(
        manifest, min(cfg.train.seq_length, model.config.max_position_embeddings), e.max_sequences
    )
    instruction = instruction_windows(manifest, windows)  # instruction data: the responses' bound
    say = echo or (lambda line: print(line, file=sys.stderr))  # stdout may be a JSON result
    part = _timed(say)
    part(f"bound of the trained model: {len(windows)} held-out windows, {e.mc_samples} noise draws each")
    bounds = {
        "trained": likelihood_bound(
            model, windows, cfg, progress=Progress("bound", "windows", say), tokenizer=tok, instruction=instruction
        ).to_dict()
    }
    if untrained and e.untrained_baseline:
        part("bound of an untrained model (the baseline)")
        torch.manual_seed(cfg.train.seed)  # the same init distribution as training, weights never updated
        # initialised in fp32 on the CPU, then cast: the same weights whatever eval.device and eval.dtype are
        untrained_model = DiffLMForMaskedLM(model.config).to(device=device, dtype=dtype).eval()
        bounds["untrained"] = likelihood_bound(
            untrained_model, windows, cfg, tokenizer=tok, instruction=instruction
        ).to_dict()
    docs = heldout_documents(manifest, tok)
    scorer = Scorer(model, tok, mc_samples=e.mc_samples, seed=e.seed)
    items = build_items(docs, e.task_items, e.seed) if e.task_items else {}
    out_dir = Path(out_dir) if out_dir else default_out_dir(cfg, str(hf_dir), Path(hf_dir), manifest.hash)
    part(f"tasks: {', '.join(f'{name} ({len(v)} items)' for name, v in items.items()) or 'none'}")
    tasks: dict[str, dict] = {}
    for name, task_items in items.items():  # one progress line per task: its own total and ETA
        scorer.progress = Progress(f"task {name}", "requests", say)
        tasks.update(score_tasks(scorer, {name: task_items}))
    scorer.progress = None
    identity = model_identity(model, Path(hf_dir))
    settings = sampler_settings(e)  # fixed here, before any generation is scored
    decode = decoding(settings, e.gen_length, e.seed, identity["mode"], identity["block_size"])
    for name in tasks:
        tasks[name]["protocol"] = task_protocol(
            name, items[name], lm_eval_task_config(name), SCORER_NAMES[name], stop_sequences=[]
        )
    efficiency: dict | None = None
    if items.get("cloze"):
        part(f"generation: cloze_gen ({len(items['cloze'])} items, {e.gen_length} tokens each), then the speed")
        gen = score_generation(scorer, items["cloze"], settings, e.gen_length)
        gen["protocol"] = task_protocol(
            "cloze_gen",
            items["cloze"],
            lm_eval_task_config("cloze_gen"),
            "exact match of the generated word",
            stop_sequences=STOP,
            filters=FILTERS,
        )
        tasks["cloze_gen"] = gen
        prompts = [it["context"] for it in items["cloze"]]
        efficiency = {
            **decode_counts(gen["samples"]),
            **speed(scorer, prompts, e.gen_length, settings, e.speed_batch, e.speed_repeats),
        }
    part(f"{e.num_samples} samples, {e.sampler.steps} sampler steps")
    samples = generate_samples(scorer, e, e.prompts or default_prompts(docs, e.num_samples, e.prompt_words))
    where = placement(model)  # bf16 scores differ from fp32 ones by the model's arithmetic: say which these are
    baseline = baseline_row(cfg, items.get("cloze") or [], manifest, say) if e.baseline else None
    part("done: writing results")
    record = EvalRecord(
        mode=model.config.model_running_mode,
        data_hash=manifest.hash,
        export=str(hf_dir),
        **where,
        bounds=bounds,
        tasks=tasks,
        task_settings=task_settings(e),
        sampler=asdict(settings),
        samples=samples,
        model=identity,
        decoding=decode,
        efficiency=None if efficiency is None else {**efficiency, **where},
        baseline=baseline,
        environment=environment(),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / EVAL_KEY).unlink(missing_ok=True)  # the pipeline's key named other results: it evaluates again
    record.write(out_dir)
    if items:
        write_lm_eval_tasks(items, out_dir / "lm_eval_tasks")
    return record.replace(report=str(write_comparison(Path(cfg.workdir).resolve(), manifest.hash)))


def task_settings(e: EvalConfig) -> dict:
    """The record's task settings: items per task, draws per request and per window, windows, seed."""
    return {
        "items": e.task_items,
        "mc_samples": e.mc_samples,
        "seed": e.seed,
        "t_samples": e.t_samples,
        "max_sequences": e.max_sequences,
    }


def reuse_check(
    cfg: PipelineConfig, manifest: DataManifest, hf_dir: Path, out_dir: Path
) -> tuple[EvalRecord | None, str]:
    """(the record in out_dir, "") when it evaluated these weights on this data with these settings (nothing to
    recompute), else (None, what differs; "" when there is no record)."""
    if not (out_dir / RESULTS).is_file():
        return None, ""
    try:
        old = EvalRecord.read(out_dir)
    except EvalRecordError as err:
        return None, str(err)
    if old.decoding is None:
        return None, "the record there was written before records held their decoding settings"
    e = cfg.eval
    sampler = asdict(sampler_settings(e))
    want = {
        "weights": files_digest(Path(hf_dir), WEIGHTS),
        "config": files_digest(Path(hf_dir), CONFIG),
        "data": manifest.hash,
        "dtype": str(resolve_device(e.device, e.dtype)[1]).removeprefix("torch."),
        **{f"task_settings.{k}": v for k, v in task_settings(e).items()},
        **{f"eval.sampler.{k}": v for k, v in sampler.items()},
        "eval.gen_length": e.gen_length,
        "eval.baseline": e.baseline,
        "sweep": [*sorted(e.steps_sweep), *sorted(e.threshold_sweep, reverse=True)],
    }
    have = {
        "weights": (old.model or {}).get("weights_sha256"),
        "config": (old.model or {}).get("config_sha256"),
        "data": old.data_hash,
        "dtype": old.dtype,
        **{f"task_settings.{k}": (old.task_settings or {}).get(k) for k in task_settings(e)},
        **{f"eval.sampler.{k}": old.decoding.get(k) for k in sampler},
        "eval.gen_length": old.decoding.get("gen_length"),
        "eval.baseline": (old.baseline or {}).get("source"),
        "sweep": [
            r["steps"] if r.get("setting", "steps").startswith("steps") else float(r["setting"].split()[1])
            for r in old.sweep or []
        ],  # fmt: skip
    }
    if not objective_class(old.mode).unmasks:  # no sweep for these (sweep_export)
        want.pop("sweep"), have.pop("sweep")
    diff = [f"{k} {have[k]} -> {want[k]}" for k in want if have.get(k) != want[k]]
    return (old if not diff else None), "; ".join(diff)


def baseline_row(cfg: PipelineConfig, items: list[dict], manifest: DataManifest, say) -> dict:
    """eval.baseline (an AR model) decoded on the same items, with the same engine, on the same device: its
    exact match, NFE, TPF and tokens/s for the record's baseline row."""
    e = cfg.eval
    hf_dir = resolve_export(str(e.baseline), tracking_uri(cfg), cfg.tracking)
    model, tok = load_model(hf_dir, *eval_device(e)), load_tokenizer(hf_dir)
    if model.objective.bidirectional:
        raise EvaluationError(
            f"eval.baseline={e.baseline} is a {model.config.model_running_mode} model: the baseline row is an AR "
            "model's (train one with diffusion.model_running_mode=ar), or unset eval.baseline"
        )
    check_tokenizer(model, manifest, hf_dir)
    say(f"[eval] the AR baseline {e.baseline}: the same {len(items)} items")
    scorer = Scorer(model, tok, seed=e.seed)
    settings = sampler_settings(e)
    gen = score_generation(scorer, items, settings, e.gen_length)
    prompts = [it["context"] for it in items]
    return {
        "source": str(e.baseline),
        "export": str(hf_dir),
        "mode": model.config.model_running_mode,
        "model": model_identity(model, hf_dir),
        "exact_match_strict": gen["exact_match_strict"],
        "exact_match_flexible": gen["exact_match_flexible"],
        "items": gen["items"],
        **decode_counts(gen["samples"]),
        **speed(scorer, prompts, e.gen_length, settings, e.speed_batch, e.speed_repeats),
        **placement(model),
    }


def _timed(echo: Callable[[str], None]) -> Callable[[str], None]:
    """`part(text)`: echo `[eval] text`, with the seconds since the first part began."""
    start: list[float] = []

    def part(text: str) -> None:
        start.append(start[0] if start else time.perf_counter())
        echo(f"[eval] {text}" + (f" (+{time.perf_counter() - start[0]:.1f} s)" if len(start) > 1 else ""))

    return part


def default_out_dir(cfg: PipelineConfig, source: str, hf_dir: Path, data_hash: str | None = None) -> Path:
    """Where the evaluation of `hf_dir` on the data `data_hash` goes: for a run's final export (<run>/hf),
    <run>/eval on the run's own data and <run>/eval-<data hash> on other data, so results on other data never
    replace the run's own; else <workdir>/evals/<source as a name>(-<data hash> on other data than the run's)."""
    run = RunDir.holding(hf_dir)
    if run is not None and Path(hf_dir).resolve() == run.hf.resolve():
        return run.eval_dir(data_hash)
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in source.strip("/"))[-80:]
    if run is not None and data_hash and data_hash != run.data_hash():
        slug = f"{slug}-{data_hash}"
    return Workdir.of(cfg).evals / slug


def sweep_export(cfg: PipelineConfig, manifest: DataManifest, hf_dir: Path, out_dir: Path) -> list[dict]:
    """Exact match of generated words, TPF and tokens/s at each of eval.steps_sweep, then each of
    eval.threshold_sweep (masked modes only); sweep.json and sweep.png in out_dir, and the rows with their AUP
    added to the evaluation record there (results.json), when there is one."""
    e = cfg.eval
    model, tok = load_model(hf_dir, *eval_device(e)), load_tokenizer(hf_dir)
    if not (e.steps_sweep or e.threshold_sweep) or not model.objective.unmasks:
        return []
    items = build_items(heldout_documents(manifest, tok), e.task_items or 32, e.seed)["cloze"]
    rows = sweep_steps(
        Scorer(model, tok, seed=e.seed),
        items,
        sampler_settings(e),
        sorted(e.steps_sweep),
        new_tokens=e.gen_length,
        echo=lambda line: print(line, file=sys.stderr),
        thresholds=sorted(e.threshold_sweep, reverse=True),
    )
    where = placement(model)
    rows = [{**r, **where} for r in rows]  # tokens/s means nothing without the hardware and precision
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.json").write_text(json.dumps(rows, indent=2))
    plot_sweep(
        rows,
        out_dir / "sweep.png",
        f"{model.config.model_running_mode} on {where['device_name']} "
        f"({where['dtype']}): quality and speed against parallelism",
    )
    if (out_dir / RESULTS).is_file():  # the record of this evaluation gains its sweep and AUP
        record = EvalRecord.read(out_dir)
        value = sweep_aup(rows)
        record.replace(
            sweep=rows,
            aup={
                "value": value,
                "points": len(rows),
                "x": "tpf",
                "y": "cloze_gen exact_match_flexible (percent)",
                "alpha": 3.0,
                "definition": "d3LLM: area under accuracy x min(exp(-3 (1 - y / y_max)), 1) against TPF",
            },
        ).write(out_dir)
    return rows
