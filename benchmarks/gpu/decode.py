"""The `decode` section: decoding speed on the device (benchmarks/gpu/decoding.py, the measurement
`benchmarks/generate.py` makes) for one-token-per-step, fixed-k, threshold, block diffusion with and without its
exact KV cache, and AR with its KV cache, at each batch size of the plan, on two kinds of model:
- random models of SmolLM2-135M's shape (what a call costs at that size; their outputs mean nothing);
- confident models the trainer trains in the same run (masked, block, AR; the small preset) on a corpus whose
  first successor has probability `dominant` (benchmarks/gpu/corpus.py), so that threshold decoding fires.

Each row: tokens/s and its speed-up over one-token-per-step of the same model kind and batch, model calls per
token, peak memory, agreement with that baseline row, and (on the corpus' chain) the share of generated token pairs
that are the dominant successor. Goal: block + cache and threshold decoding >= 3x the baseline's tokens/s on the
confident model at equal output.

The main process makes the corpus and runs the trainer (megatron and the config tree come from the wheels, imported
inside the functions); the decoding itself runs in a worker under torchrun (`worker_decode`) with the section's
timeout, its rows reaching the report as they come.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from benchmarks.gpu import decoding, training
from benchmarks.gpu.corpus import SPECIALS, make_dataset, markov_documents
from benchmarks.gpu.runtime import SectionFailed, read_jsonl, worker
from difflm.manifest import DataManifest
from difflm.models.diffusion.modes import objective_class
from difflm.models.evaluation.scoring import Scorer

MASKED, BLOCK, AR = "difflm-noshift", "difflm-block", "ar"  # the models this section trains (the goal: MASKED, BLOCK)
MODES = (MASKED, BLOCK, AR)
# the confident models train on the local spec's dense masks with the reference kernels: no compile at a process's
# start (FlexAttention's block mask and the fused kernels take tens of seconds on a GPU; train-block measures
# those), and at the small preset and length 256 the dense masks cost nothing
QUICK_TO_START = {"backend": "local", "fusions": "off"}
RANDOM = "random"
CONFIDENT = "confident"  # (a row's model label starts with it)
# the random models' shapes by the plan's name: SmolLM2-135M's, or a tiny one for the dry run
SHAPES = {
    "smollm2-135m": decoding.SMOLLM2_135M,
    "tiny": {
        "vocab_size": 128,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 64,
    },
}


def decoders(mode: str, n: int) -> dict[str, dict]:
    """The rows of a model of `mode`: the samplers of benchmarks/generate.py the issue's table names."""
    if not objective_class(mode).bidirectional:  # left to right: one decoder
        return {decoding.AR: {}}
    if decoding.has_blocks(mode):  # blocks: the block decoders, with and without the KV cache
        return decoding.other_decoders(n)
    masked = decoding.samplers(n)
    names = (decoding.BASELINE, "low-confidence, 2 tokens/step", "low-confidence, 4 tokens/step")
    names += ("threshold 0.9 (Fast-dLLM)", "threshold 0.7 (Fast-dLLM)")
    return {k: masked[k] for k in names}


def section(check, state: dict) -> dict:
    """The confident corpus; the three confident models trained and exported; then one decoding worker, the
    confident models first (the goal's rows), the random ones after. A mode whose training fails is recorded and
    left out; a worker that fails or runs out of time keeps the rows it measured (the rows file)."""
    from difflm.config import load_config
    from difflm.models.hf.convert import export_hf
    from difflm.rundir import RunDir

    p, d, out = check.p, check.p["decode"], check.out
    corpus = {**p, "vocab": d["vocab"], "documents": d["documents"], "doc_len": d["doc_len"]}
    manifest = make_dataset(corpus, out / "data-confident", dominant=d["dominant"])
    manifest_path = out / "data-confident" / "manifest.json"
    trained, errors, folders = {}, {}, {}
    for mode in MODES:
        tag = f"confident-{mode}"
        diffusion = {"block_size": d["block_size"]} if decoding.has_blocks(mode) else {}
        try:
            trained[mode] = training.train(
                check, "decode", manifest_path, mode, tag, preset=d["preset"], seq=d["seq"], steps=d["steps"],
                train={"micro_batch_size": d["mbs"], "global_batch_size": d["mbs"], "optimizer": {"lr": d["lr"]}},
                diffusion=diffusion, model=QUICK_TO_START,
            )  # fmt: skip
            run = RunDir(trained[mode]["run_dir"])
            cfg = load_config(str(out / f"config-{tag}.yaml"))
            folders[mode] = str(export_hf(cfg, manifest.tokenizer.to_dict(), run.checkpoint(run.latest_iteration()),
                                          out / f"hf-{tag}").folder)  # fmt: skip
        except Exception as exc:  # this mode's rows only: the others are still measured
            errors[mode] = f"{type(exc).__name__}: {exc}"[:400]
    spec = out / "decode-models.json"
    spec.write_text(json.dumps({"folders": folders}))
    try:
        got = worker(check, "decode", manifest_path, name="decode", tag="decode", models=spec)
        rows, records = got["rows"], got.get("records", [])
    except Exception as exc:  # a timeout included: the rows measured so far are in the rows file
        errors["decoding"] = f"{type(exc).__name__}: {exc}"[:400]
        rows, records = read_jsonl(out / "decode-rows.jsonl"), []
    result = {"rows": rows, "goal": goal(rows), "dominant": d["dominant"], "trained": trained, "errors": errors}
    result["records"] = records  # evaluation records (difflm compare reads them), one per model and batch size
    if not rows:
        raise SectionFailed(f"no decoding rows: {errors}", result)
    return result


def prompts(table, n_prompts: int, length: int, dominant: float) -> list[str]:
    """Prompts of `length` tokens from the corpus' chain (a seed of their own), as the scorer's id text."""
    docs = markov_documents({"documents": n_prompts, "doc_len": [length, length]}, table, seed=7, dominant=dominant)
    return [" ".join(str(int(t)) for t in doc) for doc in docs]


def dominant_share(tokens: list[list[int]], table) -> float | None:
    """Share of generated adjacent pairs (a, b) where b is a's dominant successor (greedy decoding of a model that
    learnt the chain gives ~1)."""
    pairs = [(a, b) for t in tokens for a, b in zip(t[:-1], t[1:]) if len(SPECIALS) <= a < len(table)]
    return sum(int(table[a][0]) == b for a, b in pairs) / len(pairs) if pairs else None


def worker_decode(args, p: dict) -> dict:
    """Every decoder of every mode at every batch size of the plan, on the confident exports (args.models) first,
    then on the random models; one row appended to the rows file as each is measured."""
    from difflm.models.hf.convert import load_hf  # (transformers' remote-code loader: the exports' own code)

    d = p["decode"]
    spec = json.loads(Path(args.models).read_text())
    manifest = DataManifest.read(args.manifest)
    table = np.load(Path(manifest.dir) / "markov.npy")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    n = d["new_tokens"]
    texts = prompts(table, max(d["batches"]), d["prompt_len"], d["dominant"])
    rows: list[dict] = []
    kinds = [(CONFIDENT, mode) for mode in MODES if mode in spec["folders"]] + [(RANDOM, mode) for mode in MODES]
    baselines: dict[tuple[str, int], dict] = {}  # (kind, batch size) -> the baseline row and its tokens
    for kind, mode in kinds:
        if kind == RANDOM:
            model = decoding.random_model(SHAPES[d["random"]], mode, d["block_size"])
            label = f"{d['random']}-shaped, random"
        else:
            model, label = load_hf(Path(spec["folders"][mode])), f"{CONFIDENT} ({d['preset']})"
        model = model.to(device=device, dtype=dtype)
        for batch in d["batches"]:
            scorer = Scorer(model, decoding.IdTokenizer(), batch_size=batch, seed=0)
            some = texts[: d["batch1_prompts"] if batch == 1 else batch]  # one batch, or a few prompts one by one
            decoding.warm_up(scorer, some, n)
            for name, fields in decoders(mode, n).items():
                base = baselines.get((kind, batch))
                row, _, tokens = decoding.measure(scorer, some, n, name, fields, base and base["tokens"])
                if base is None and name == decoding.BASELINE:
                    base = baselines[kind, batch] = {"row": row, "tokens": tokens}
                row |= {"model": label, "mode": mode, "prompts": len(some), "new_tokens": n,
                        "dominant_share": dominant_share(tokens, table)}  # fmt: skip
                row["speedup"] = _speedup(row, base)
                _append(args, row)
                rows.append(row)
        del model
        if cuda:
            torch.cuda.empty_cache()
    records = write_records(rows, Path(args.rows).parent / "decode-records", manifest.hash, spec["folders"])
    return {"rows": rows, "records": [str(r) for r in records]}


def write_records(rows: list[dict], out: Path, data_hash: str, folders: dict[str, str]) -> list[Path]:
    """One evaluation record (models/evaluation/record.py, as `difflm eval` writes) per model and batch size: its
    decoders as the sweep (accuracy: the share of generated pairs that follow the chain's dominant successor), the
    baseline decoder's counters as its efficiency, the AUP over the decoders; `difflm compare` reads them."""
    from difflm.models.evaluation.protocol import environment
    from difflm.models.evaluation.record import EvalRecord
    from difflm.models.evaluation.sweep import sweep_aup

    written = []
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["mode"], r["batch_size"]), []).append(r)
    for (label, mode, batch), group in groups.items():
        sweep = [
            {"setting": r["sampler"], "steps": r["settings"].get("steps"), "accuracy": r.get("dominant_share"),
             "tpf": r.get("tpf"), "nfe": r.get("nfe"), "tokens_per_s": r["tokens_per_s"]}
            for r in group
        ]  # fmt: skip
        base = group[0]
        scored = [row for row in sweep if row["accuracy"] is not None]
        record = EvalRecord(
            mode=mode,
            data_hash=data_hash,
            export=folders.get(mode, "random weights") if label.startswith(CONFIDENT) else f"random weights ({label})",
            device=str(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
            dtype="bfloat16" if torch.cuda.is_available() else "float32",
            device_name=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            bounds={},
            decoding={**base["settings"], "gen_length": base["new_tokens"], "decoder": base["sampler"]},
            efficiency={k: base.get(k) for k in ("nfe", "valid_tokens", "tpf", "tokens_per_s", "peak_memory_gb")}
            | {"batch_size": batch, "timing": "benchmarks/gpu/decoding.measure: one call per batch, synchronised"},
            sweep=sweep,
            aup={"value": sweep_aup(scored), "points": len(scored), "x": "tpf", "y": "dominant-successor share"}
            if scored
            else None,
            environment=environment(),
        )
        folder = out / f"{'confident' if label.startswith(CONFIDENT) else 'random'}-{mode}-batch{batch}"
        written.append(record.write(folder))
    return written


def _speedup(row: dict, base: dict | None) -> float | None:
    """Tokens/s over the baseline row of the same batch size (per prompt: batch 1 decodes fewer prompts)."""
    if base is None:
        return None
    return row["tokens_per_s"] / base["row"]["tokens_per_s"]


def _append(args, row: dict) -> None:
    with open(args.rows, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def goal(rows: list[dict], target: float = 3.0) -> dict:
    """The decoding goal on the confident model, per batch size: the best speed-up of the threshold rows whose
    output equals the baseline's (agreement >= 0.99), and of the block + KV cache rows whose output follows the
    chain as often as the baseline's does (dominant share within 0.01; another model: agreement is indicative)."""
    out: dict = {}
    confident = [r for r in rows if r["model"].startswith(CONFIDENT)]
    for batch in sorted({r["batch_size"] for r in confident}):
        at = [r for r in confident if r["batch_size"] == batch and r.get("speedup") is not None]
        base = next((r for r in at if r["sampler"] == decoding.BASELINE), None)
        if base is None:
            continue
        threshold = [r["speedup"] for r in at if "threshold" in r["sampler"] and r["mode"] == MASKED
                     and r["agreement"] >= 0.99]  # fmt: skip
        block = [r["speedup"] for r in at if "KV cache" in r["sampler"] and r["mode"] == BLOCK
                 and (r["dominant_share"] or 0) >= (base["dominant_share"] or 0) - 0.01]  # fmt: skip
        best_t, best_b = max(threshold, default=None), max(block, default=None)
        out[f"batch {batch}"] = {
            "threshold_speedup": best_t,
            "block_cache_speedup": best_b,
            "met": best_t is not None and best_b is not None and min(best_t, best_b) >= target,
        }
    return out
