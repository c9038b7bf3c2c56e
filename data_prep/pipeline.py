"""Raw text -> tokenized, packed Megatron .bin/.idx per (split, source), verified, with a manifest.

One datatrove pipeline: per source a reader of this task's share of the input bytes, optional cleaning
(unicode normalisation, length filter, exact dedup), and a writer that tokenizes and routes each
document to its split (hash of the text) and source. Executors: datatrove local (workers), Slurm, Ray.
With `data.dedup` or `data.max_documents`, every task reads every record and a hash of the text picks
the documents of each task instead (see difflm.data_prep.readers).

What does not depend on the number of tasks (nor on how the input is cut into files): the documents of
each (split, source), with their tokens, and so each split's document and token counts. Their order
within and across the per-task shards does.

The output folder is named by a hash of the data and tokenizer config. datatrove's completion
markers make an interrupted run finish only its missing tasks (the result is byte-identical to an
uninterrupted run); `manifest.json` is written last, after verification, and marks the folder done.

Bad input costs only what cannot be read: skipped records are counted by reason in the manifest's
`skipped`, damaged, unreadable and ignored files are listed in `file_problems` with one warning line
each, and the run ends with one summary line. `data.strict` turns a damaged file into an error.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from datatrove.utils.logging import logger

from difflm.config import PipelineConfig, SourceConfig
from difflm.data_prep import instruction_tasks
from difflm.data_prep.budget import document_order, select, subset_tokens, write_subset
from difflm.data_prep.chat import TemplateError, TemplateSpec, resolve_template
from difflm.data_prep.corpus import SOURCES, demo_corpus
from difflm.data_prep.errors import DataPrepError, SubmittedToCluster
from difflm.data_prep.instructions import REJECTS, InstructionWriter, make_instruction_reader, reject_lines
from difflm.data_prep.quiet import QuietLocalExecutor  # per-file and per-task INFO to the task logs only
from difflm.data_prep.readers import detect_format, make_reader, unknown_files
from difflm.data_prep.slurm import forget_credentials, slurm_executor
from difflm.data_prep.split import SPLITS, split_of
from difflm.data_prep.steps import ExactDedup, HashShard, LengthFilter, SplitSourceWriter, UnicodeNormalizer
from difflm.data_prep.tokenizer import TokenizerError, TokenizerInfo, describe, load_tokenizer, train_bpe
from difflm.data_prep.tolerant import DamagedFileError, load_faults
from difflm.data_prep.verify import read_index, verify
from difflm.errors import disk_full, is_disk_full
from difflm.locks import exclusive
from difflm.manifest import LOSS_MASK_SUFFIX, DataManifest, SplitStats
from difflm.rundir import Workdir, lock_file

MANIFEST = "manifest.json"
FAULTS = "logs/file_faults"  # one JSON report per damaged or unreadable input file


def resolve_source(src: SourceConfig) -> tuple[Path, str]:
    """(path, format) of a source; clear errors for paths that do not exist or hold no data."""
    if src.path in instruction_tasks.SOURCES:
        return instruction_tasks.demo_instructions(src.path), "jsonl"
    if src.path.startswith("demo:"):
        return demo_corpus(src.path.split(":", 1)[1]), "jsonl"
    path = Path(src.path).expanduser()
    if not path.exists():
        raise DataPrepError(f"data.sources: {src.path!r} does not exist; give a file or a folder of data files")
    try:
        fmt = detect_format(path) if src.format == "auto" else src.format
    except ValueError as err:
        raise DataPrepError(f"data.sources: {err}") from None
    return path.resolve(), fmt


def preflight(cfg: PipelineConfig) -> None:
    """Cheap checks of the inputs before any work: sources exist and have a known format, the tokenizer
    path exists. Raises DataPrepError / TokenizerError with what to do."""
    for src in cfg.data.sources:
        resolve_source(src)
    _template(cfg)  # instruction data: a template the tokenizer does not have is named before any work
    if cfg.tokenizer.path:
        path = Path(cfg.tokenizer.path).expanduser()
        if not (path / "tokenizer.json" if path.is_dir() else path).exists():
            raise TokenizerError(
                f"tokenizer.path {cfg.tokenizer.path!r}: no tokenizer.json found there; give a local "
                f"Hugging Face tokenizer folder or the tokenizer.json file"
            )


def reader_steps(
    cfg: PipelineConfig,
    resolved: list[tuple[SourceConfig, Path, str]],
    progress: bool = False,
    report_dir: Path | None = None,
):
    steps = []
    for src, path, fmt in resolved:
        if cfg.data.kind == "instruction":
            reader = _instruction_reader(cfg, src, path, fmt, progress, report_dir)
        else:
            reader = make_reader(path, fmt, src.text_key or cfg.data.text_key, src.label, progress)
        reader.by_input = reads_by_input(cfg)
        reader.limit = cfg.data.max_documents or -1
        reader.strict = cfg.data.strict
        reader.report_dir = str(report_dir) if report_dir else None
        steps.append(reader)
    return steps


def _instruction_reader(cfg: PipelineConfig, src: SourceConfig, path: Path, fmt: str, progress: bool, report_dir):
    """The reader of instruction records (difflm.data_prep.instructions): conversations as documents."""
    try:
        reader = make_instruction_reader(path, fmt, src.label, cfg.data.instruction_keys, progress)
    except ValueError as err:
        raise DataPrepError(f"data.sources: {src.path}: {err} (data.kind=instruction)") from None
    reader.normalization = cfg.data.unicode_normalization
    reader.rejects_dir = str(Path(report_dir).parent.parent / REJECTS) if report_dir else None
    return reader


def reads_by_input(cfg: PipelineConfig) -> bool:
    """Whether each task reads only its share of the input: exact dedup and a document count need every
    document in view, so with either every task reads everything and keeps its documents by text hash."""
    return not (cfg.data.dedup or cfg.data.max_documents)


def check_inputs(cfg: PipelineConfig, resolved) -> None:
    """data.strict: read every input once, before any work, so that a damaged file fails the prep early
    (in-process: no half-written output, no datatrove traceback). Raises DamagedFileError."""
    for reader in reader_steps(cfg, resolved):
        reader.quiet = True  # the tokenized pass reports the skipped records
        for _ in reader.run(None, rank=0, world_size=1):
            pass


def refuse_empty_sources(cfg: PipelineConfig, resolved) -> None:
    """A source with no record at all (an empty file, a folder of them) is named in one error: the empty splits it
    led to said "change data.valid_fraction", once per split and stage. Reads up to one record of each source."""
    for reader, (src, path, fmt) in zip(reader_steps(cfg, resolved), resolved, strict=True):
        reader.quiet, reader.limit, reader.strict, reader.doc_progress = True, 1, False, False
        if _first_record(reader) is None:
            if cfg.data.strict:  # a damaged file is named as such first
                try:
                    check_inputs(cfg, [(src, path, fmt)])
                except DamagedFileError as err:
                    raise DataPrepError(f"data.strict: {err}") from None
            raise DataPrepError(
                f"{path} has no readable records (source {src.label!r}): give it documents, or remove it from "
                "data.sources"
            )


# The loggers of the readers' per-file INFO lines ("Reading input file ..."): datatrove's and ours (tolerant.py)
READER_LOGGERS = ("datatrove.pipeline.readers", "difflm.data_prep.tolerant")


@contextmanager
def _readers_silent(modules: tuple[str, ...] = READER_LOGGERS):
    """The readers' log lines off while a pass runs in this process: outside the executor's quiet task logger they
    would reach the terminal (datatrove's default sink), where docs/data.md promises the task logs only. The
    passes that use it (the first record of each source, the tokenizer's texts) are extra: the tokenized pass,
    in the executor, reads every file again and reports its skips and damage."""
    for module in modules:
        logger.disable(module)
    try:
        yield
    finally:
        for module in modules:
            logger.enable(module)


def _first_record(reader):
    """One record of a reader, its log lines off (`_readers_silent`), before the prep has even started."""
    with _readers_silent(("datatrove", *READER_LOGGERS)):
        return next(iter(reader.run(None, rank=0, world_size=1)), None)


def ignored_files(resolved) -> list[dict]:
    """Files of the source folders that no reader reads, each named in one warning line."""
    found = []
    for src, path, fmt in resolved:
        for f in unknown_files(path, fmt):
            found.append({"file": str(f), "problem": "unknown extension", "error": "", "records_read": 0})
            _warn(
                f"{f} is not read: source {src.label!r} reads {fmt} files and this name has another extension. "
                f"Rename it if it holds {fmt} data, or give it as a source of its own"
            )
    return found


def _warn(message: str) -> None:
    print(f"warning: data prep: {message}", file=sys.stderr, flush=True)


def warn_file_faults(faults: list[dict], out: Path) -> None:
    """One warning line per damaged or unreadable file (reported by the readers in the first task)."""
    for f in faults:
        if f["problem"] == "damaged":
            kept = (
                f"kept the {f['records_read']} records before the damage"
                if f["records_read"]
                else "no record before the damage was readable"
            )
            _warn(
                f"{f['file']} is damaged ({f['error']}); {kept}. To read the rest, repair or replace it, delete "
                f"{out} and rerun (data.strict=true fails instead)"
            )
        else:
            _warn(
                f"{f['file']} cannot be read ({f['error']}); skipped it. To read it, fix it, delete {out} and "
                f"rerun (data.strict=true fails instead)"
            )


def cleaning_steps(cfg: PipelineConfig) -> list:
    d = cfg.data
    steps: list = []
    if d.kind == "instruction":  # a conversation's text is JSON: the readers normalise and check each turn instead
        return [ExactDedup()] if d.dedup else []
    if d.unicode_normalization:
        steps.append(UnicodeNormalizer(d.unicode_normalization))
    steps.append(LengthFilter(d.min_chars, d.max_chars))
    if d.dedup:
        steps.append(ExactDedup())
    return steps


def iter_texts(cfg: PipelineConfig, resolved) -> Iterator[str]:
    """Texts of the kept documents, in input order (the same readers and filters, in-process)."""
    readers = reader_steps(cfg, resolved)
    for r in readers:
        r.quiet = True  # the tokenized pass reports the skipped records
    data = None
    for step in [*readers, *cleaning_steps(cfg)]:
        data = step.run(data, rank=0, world_size=1)
    with _readers_silent():  # in this process: the per-file lines would reach the terminal
        for doc in data:
            if cfg.data.kind == "instruction":  # the turns' text, not the conversation's JSON, trains the BPE
                yield "\n".join(m["content"] for m in json.loads(doc.text))
            else:
                yield doc.text


def prepare_tokenizer(cfg: PipelineConfig, resolved, folder: Path) -> TokenizerInfo:
    """Load the configured tokenizer, or train a BPE on the training split (reused when present)."""
    if (folder / "tokenizer.json").exists():
        return describe(folder, cfg.tokenizer)
    if cfg.tokenizer.path:
        return load_tokenizer(cfg.tokenizer, folder)
    d = cfg.data
    if d.kind == "instruction":  # a conversation's split is its JSON's: every one trains the tokenizer
        return train_bpe(iter_texts(cfg, resolved), cfg.tokenizer, folder)
    texts = (
        t for t in iter_texts(cfg, resolved) if split_of(t, d.valid_fraction, d.split_seed, d.test_fraction) == "train"
    )
    return train_bpe(texts, cfg.tokenizer, folder)


def build_executor(cfg: PipelineConfig, pipeline: list, out: Path):
    """The datatrove executor of the prep writing `out` (its logs in `out`/logs)."""
    d = cfg.data
    logging_dir = out / "logs"
    if d.executor == "slurm":
        return slurm_executor(cfg, pipeline, out)
    if d.executor == "ray":
        try:
            from datatrove.executor.ray import RayPipelineExecutor  # an optional back-end
        except ImportError as err:
            raise DataPrepError("data.executor=ray needs ray: pip install 'ray[default]'") from err
        return RayPipelineExecutor(
            pipeline=pipeline, tasks=d.num_tasks, workers=d.workers, logging_dir=str(logging_dir)
        )
    return QuietLocalExecutor(pipeline=pipeline, tasks=d.num_tasks, workers=d.workers, logging_dir=str(logging_dir))


def tokenizer_threads(cfg: PipelineConfig) -> int | None:
    """Tokenizer threads per task: local workers share this machine's cores (each would start one thread per
    core); one worker, Slurm and Ray tasks keep the tokenizer's default (all the cores the task sees)."""
    d = cfg.data
    if d.executor != "local" or d.workers == 1:
        return None
    return max(1, len(os.sched_getaffinity(0)) // d.workers)


def run_pipeline(cfg: PipelineConfig, resolved, tok: TokenizerInfo, out: Path, template: TemplateSpec | None) -> None:
    d = cfg.data
    args = (str(out), tok.json_file, cfg.tokenizer.eos_token, d.valid_fraction, d.test_fraction, d.split_seed)
    mask, threads = cfg.tokenizer.mask_token, tokenizer_threads(cfg)
    writer: SplitSourceWriter = (
        SplitSourceWriter(*args, mask_token=mask, threads=threads)
        if template is None
        else InstructionWriter(
            *args, mask_token=mask, threads=threads, template=template.to_dict(), rejects_dir=str(out / REJECTS)
        )
    )
    pipeline = [
        *reader_steps(cfg, resolved, progress=d.workers == 1, report_dir=out / FAULTS),
        *([] if reads_by_input(cfg) else [HashShard()]),
        *cleaning_steps(cfg),
        writer,
    ]
    executor = build_executor(cfg, pipeline, out)
    executor.run()
    if d.executor == "slurm":
        incomplete = executor.get_incomplete_ranks()
        if incomplete:
            raise SubmittedToCluster(
                f"submitted {len(incomplete)} data-prep tasks to Slurm (logs: {out / 'logs'}); rerun the same "
                f"command when the job has finished to verify and write the manifest"
            )
        forget_credentials(out)


def skip_counts(logs: Path) -> dict[str, int]:
    """Skipped (bad records and files), dropped (filters) and changed (repaired, normalised) document
    counts, summed over every task's stats file, so they add up across resumed runs too."""
    totals: dict[str, int] = {}
    for path in sorted((logs / "stats").glob("*.json")):
        for step in json.loads(path.read_text()):
            for key, val in step.get("stats", {}).items():
                if key.startswith(("skipped_", "dropped_", "replaced_", "stripped_")) or key == "normalized":
                    n = val.get("total", 0) if isinstance(val, dict) else val
                    totals[key] = totals.get(key, 0) + int(n)
    return totals


def shard_stats(out: Path, sources: list[SourceConfig]) -> dict[str, SplitStats]:
    """Per split: prefixes, per-source documents/tokens, blend weights and Megatron data-path string. The
    counts come from the .idx files (read_index: megatron-core's reader would cost its import, seconds)."""
    by_size = all(s.weight is None for s in sources)  # megatron's own default: mix as the data comes
    weight = {s.label: 1.0 if s.weight is None else s.weight for s in sources}
    splits = {}
    for split in SPLITS:
        per_source, prefixes, tokens_of = {}, [], {}
        for src in sorted(weight):
            docs = toks = 0
            for idx in sorted((out / split / src).glob("*.idx")):
                prefix = str(idx.with_suffix(""))
                if prefix.endswith(LOSS_MASK_SUFFIX):  # the loss mask beside a shard (difflm.manifest.loss_mask_prefix)
                    continue
                _, lengths, _, _ = read_index(idx)
                n_tok = int(lengths.sum())
                prefixes.append(prefix)
                tokens_of[prefix] = (src, n_tok)
                docs, toks = docs + len(lengths), toks + n_tok
            per_source[src] = {"documents": docs, "tokens": toks}
        # a source's share is spread over its shards by their token counts
        if by_size:
            weights = [float(tokens_of[p][1]) for p in prefixes]
        else:
            weights = [
                weight[src] * n / max(per_source[src]["tokens"], 1) for src, n in (tokens_of[p] for p in prefixes)
            ]
        total = sum(weights) or 1.0
        weights = [w / total for w in weights]
        splits[split] = SplitStats(
            documents=sum(v["documents"] for v in per_source.values()),
            tokens=sum(v["tokens"] for v in per_source.values()),
            sources=per_source,
            prefixes=tuple(prefixes),
            weights=tuple(weights),
            data_path=" ".join(f"{w:.6g} {p}" for w, p in zip(weights, prefixes)),
        )
    return splits


def _provenance(src: SourceConfig) -> dict:
    """Origin, license and checksum of an embedded corpus (user data: nothing to add)."""
    if src.path in instruction_tasks.SOURCES:
        return dict(instruction_tasks.PROVENANCE)
    if not src.path.startswith("demo:"):
        return {}
    e = SOURCES[src.path.split(":", 1)[1]]
    return {"origin": e.origin, "license": e.license, "carrier": e.package, "sha256": e.sha256}


def summary_line(manifest: DataManifest) -> str:
    """The prep's result in one line: documents kept, and the skipped records, files and changed texts
    each summed, with their reasons."""
    docs = {split: s.documents for split, s in manifest.splits.items()}
    line = f"data prep: {sum(docs.values())} documents kept ({', '.join(f'{k} {n}' for k, n in docs.items())})"
    counts = manifest.skipped
    removed = [k for k in counts if k.startswith(("skipped_", "dropped_"))]
    groups = {
        "records skipped or dropped": [k for k in removed if not k.endswith("_file")],
        "files skipped": [k for k in removed if k.endswith("_file")],  # a count of files, not records
        "texts changed": [k for k in counts if k not in removed],
    }
    for label, keys in groups.items():
        if keys:
            line += f"; {sum(counts[k] for k in keys)} {label} ({', '.join(f'{k}={counts[k]}' for k in keys)})"
    return line


def unique_tokens(manifest: DataManifest) -> int:
    """The tokens a run trains on, each seen once per epoch: the training split's (its data.unique_tokens subset's)."""
    return manifest.unique_tokens


def data_dir(cfg: PipelineConfig) -> Path:
    """The folder of the data `cfg` trains on: its data prep, or with data.unique_tokens the subset cut from it."""
    return Workdir.of(cfg).data(cfg.stage_hash("data", "tokenizer"))


def prepare_data(cfg: PipelineConfig) -> DataManifest:
    """Run data prep for `cfg` (finishing an interrupted run, or reusing a finished one); its DataManifest. With
    data.unique_tokens, the prep of the whole split (shared by every budget, under its own lock) and then the
    subset's manifest. A full disk is one DiskFull line (nothing half-written is taken for done: the manifest is
    written last)."""
    try:
        if not (data_dir(cfg) / MANIFEST).exists():  # before the lock: a refused prep leaves no data folder behind
            refuse_empty_sources(cfg, [(src, *resolve_source(src)) for src in cfg.data.sources])
        # one writer per data folder: a second `difflm prep` (or pipeline) of the same data waits, then reuses it
        with exclusive(lock_file(data_dir(cfg)), f"data prep {data_dir(cfg)}", cfg.pipeline.on_busy):
            if cfg.data.unique_tokens is None:
                return _prepare_data(cfg)
            whole = cfg.without_budget()
            with exclusive(lock_file(data_dir(whole)), f"data prep {data_dir(whole)}", cfg.pipeline.on_busy):
                full = _prepare_data(whole)
            return budget_data(cfg, full)
    except OSError as err:
        if is_disk_full(err):
            raise disk_full(data_dir(cfg), "preparing data", "data prep starts again where it stopped") from None
        raise


def _prepare_data(cfg: PipelineConfig) -> DataManifest:
    out = data_dir(cfg)
    manifest_path = out / MANIFEST
    if manifest_path.exists():
        return DataManifest.read(manifest_path)
    resolved = [(src, *resolve_source(src)) for src in cfg.data.sources]  # refused empty ones: prepare_data
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    ignored = ignored_files(resolved)
    template = _template(cfg)
    tok = _read_inputs(cfg, resolved, out, template)
    splits = shard_stats(out, cfg.data.sources)
    skipped = skip_counts(out / "logs")
    if ignored:
        skipped["skipped_unknown_extension_file"] = len(ignored)
    faults = load_faults(out / FAULTS)
    warn_file_faults(faults, out)
    for split in ("train", "valid"):
        if splits[split].documents == 0:
            raise DataPrepError(
                f"the {split} split is empty ({splits['train'].documents} train / "
                f"{splits['valid'].documents} valid documents kept; skips: {skipped}): "
                f"add data or change data.valid_fraction"
            )
    manifest = DataManifest(
        dir=str(out),
        hash=out.name,
        kind=cfg.data.kind,
        instruction=None
        if template is None
        else {**template.to_dict(), "fields": cfg.data.instruction_keys, "sha256": template.sha256},
        sources=tuple(
            {"name": s.label, "path": str(p), "format": f, "weight": s.weight or "by tokens", **_provenance(s)}
            for s, p, f in resolved
        ),
        tokenizer=tok,
        token_bytes=4 if tok.vocab_size > 65536 else 2,
        splits=splits,
        skipped=skipped,
        file_problems=tuple(faults + ignored),
        config=_config_record(cfg),
        seconds=round(time.time() - start, 2),
    )
    verify(manifest)
    manifest.write(manifest_path)
    print(summary_line(manifest), flush=True)
    if template is not None:  # one line per kind of bad instruction record, naming the first
        folders = {s.label: str(p if p.is_dir() else p.parent) for s, p, _ in resolved}
        for line in reject_lines(out / REJECTS, skipped, folders):
            print(line, flush=True)
    return manifest


def _template(cfg: PipelineConfig) -> TemplateSpec | None:
    """The chat template of instruction data (None for pretraining data); one DataPrepError line when it has none."""
    if cfg.data.kind != "instruction":
        return None
    try:
        return resolve_template(cfg.data.chat_template, cfg.tokenizer.path)
    except TemplateError as err:
        raise DataPrepError(str(err)) from None


def _config_record(cfg: PipelineConfig) -> dict:
    """The data and tokenizer sections that made a data folder, as its manifest records them."""
    return {"data": cfg.data.model_dump(mode="json"), "tokenizer": cfg.tokenizer.model_dump(mode="json")}


def budget_data(cfg: PipelineConfig, full: DataManifest) -> DataManifest:
    """The manifest of the data.unique_tokens subset of `full`'s training split (difflm.data_prep.budget), written once
    into data_dir(cfg) and reused; its held-out splits are `full`'s own shards."""
    out = data_dir(cfg)
    manifest_path = out / MANIFEST
    if manifest_path.exists():
        return DataManifest.read(manifest_path)
    budget, seed, split = cfg.data.unique_tokens, cfg.data.subset_seed, full.split("train")
    assert budget is not None
    _check_budget(budget, full)
    chosen = select(document_order(list(split.prefixes), seed), budget)
    out.mkdir(parents=True, exist_ok=True)
    write_subset(list(split.prefixes), chosen, out, full.token_bytes)
    train = shard_stats(out, cfg.data.sources)["train"]
    manifest = full.replace(
        dir=str(out),
        hash=out.name,
        splits={**full.splits, "train": train},
        budget={
            "unique_tokens": budget,
            "subset_seed": seed,
            "tokens": train.tokens,
            "documents": train.documents,
            "split_tokens": split.tokens,
            "split_documents": split.documents,
            "from": full.dir,
        },
        config=_config_record(cfg),
    )
    verify(manifest)
    manifest.write(manifest_path)
    print(
        f"data: a budget of {train.tokens:,} unique tokens ({train.documents} documents) of the training "
        f"split's {split.tokens:,} -> {out}",
        flush=True,
    )
    return manifest


def _check_budget(budget: int, full: DataManifest) -> None:
    split = full.split("train")
    if budget > split.tokens:
        raise DataPrepError(
            f"data.unique_tokens={budget:,} is more than the training split holds ({split.tokens:,} tokens in "
            f"{split.documents:,} documents): lower it, or set data.unique_tokens=null for the whole split"
        )


def budget_tokens(cfg: PipelineConfig, full: DataManifest, orders: dict | None = None) -> int:
    """The unique training tokens `cfg` will train on, counted without writing its subset: `budget_data`'s
    (whole documents, so at least data.unique_tokens), refused as it refuses; the whole split's without a budget.
    `orders` caches the document order per seed across calls on the same `full`."""
    budget = cfg.data.unique_tokens
    if budget is None:
        return full.unique_tokens
    written = data_dir(cfg) / MANIFEST
    if written.exists():
        return DataManifest.read(written).unique_tokens
    _check_budget(budget, full)
    orders = {} if orders is None else orders
    seed = cfg.data.subset_seed
    if seed not in orders:
        orders[seed] = document_order(list(full.split("train").prefixes), seed)
    return subset_tokens(orders[seed], budget)


def _read_inputs(cfg: PipelineConfig, resolved, out: Path, template: TemplateSpec | None) -> TokenizerInfo:
    """The passes over the inputs: strict check, tokenizer training, the tokenizing pipeline. A damaged
    file under data.strict becomes one DataPrepError line, wherever it is found."""
    try:
        if cfg.data.strict:
            check_inputs(cfg, resolved)
        tok = prepare_tokenizer(cfg, resolved, out / "tokenizer")
        run_pipeline(cfg, resolved, tok, out, template)
    except DamagedFileError as err:
        raise DataPrepError(f"data.strict: {err}") from None
    return tok
