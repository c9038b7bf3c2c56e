"""Raw text -> tokenized, packed Megatron .bin/.idx per split, with a manifest.

Each split is one datatrove pipeline (readers -> filters -> split selector -> MegatronDocumentTokenizer)
on datatrove's local executor. The output folder is named by a hash of the data and tokenizer config;
`manifest.json` is written last and marks the folder complete, so a rerun of a finished prep is a no-op
and a folder without a manifest is leftovers, removed and redone.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Iterator

from difflm.config import PipelineConfig
from difflm.corpus import demo_corpus
from data_prep.split import SPLITS, split_of
from data_prep.tokenizer import TokenizerInfo, load_tokenizer, train_bpe

MANIFEST = "manifest.json"


class DataPrepError(ValueError):
    pass


def resolve_inputs(inputs: list[str]) -> list[Path]:
    """'demo:NAME' -> the cached embedded corpus; paths must exist (files or folders of .jsonl[.gz])."""
    out = []
    for item in inputs:
        if item.startswith("demo:"):
            out.append(demo_corpus(item.split(":", 1)[1]))
            continue
        path = Path(item).expanduser()
        if not path.exists():
            raise DataPrepError(f"data.inputs: {item!r} does not exist; give a JSONL file or a folder of them")
        if path.is_dir() and not any(path.rglob("*.jsonl*")):
            raise DataPrepError(f"data.inputs: folder {item!r} holds no .jsonl or .jsonl.gz files")
        out.append(path.resolve())
    return out


def readers(paths: list[Path], text_key: str, limit: int | None):
    from datatrove.pipeline.readers import JsonlReader

    steps = []
    for p in paths:
        folder, glob = (p, "**/*.jsonl*") if p.is_dir() else (p.parent, p.name)
        steps.append(JsonlReader(str(folder), glob_pattern=glob, text_key=text_key, limit=limit or -1))
    return steps


def iter_texts(cfg: PipelineConfig, paths: list[Path]) -> Iterator[str]:
    """Texts of the kept documents, in input order (runs the same readers and filters in-process)."""
    from data_prep.steps import MinCharsFilter

    data = None
    for step in [*readers(paths, cfg.data.text_key, cfg.data.max_documents), MinCharsFilter(cfg.data.min_chars)]:
        data = step.run(data, rank=0, world_size=1)
    for doc in data:
        yield doc.text


def prepare_tokenizer(cfg: PipelineConfig, paths: list[Path], folder: Path) -> TokenizerInfo:
    if cfg.tokenizer.path:
        return load_tokenizer(cfg.tokenizer, folder)
    d = cfg.data
    texts = (t for t in iter_texts(cfg, paths) if split_of(t, d.valid_fraction, d.split_seed) == "train")
    return train_bpe(texts, cfg.tokenizer, folder)


def _tokenize_split(cfg: PipelineConfig, paths: list[Path], tok: TokenizerInfo, out: Path, split: str) -> None:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.tokens import MegatronDocumentTokenizer

    from data_prep.steps import MinCharsFilter, SplitSelector

    d = cfg.data
    pipeline = [
        *readers(paths, d.text_key, d.max_documents),
        MinCharsFilter(d.min_chars),
        SplitSelector(split, d.valid_fraction, d.split_seed),
        MegatronDocumentTokenizer(
            output_folder=str(out / split), tokenizer_name_or_path=tok.json_file, eos_token=cfg.tokenizer.eos_token
        ),
    ]
    LocalPipelineExecutor(pipeline=pipeline, tasks=1, workers=1, logging_dir=str(out / "logs" / split)).run()


def _split_stats(folder: Path) -> dict:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefixes, docs, tokens = [], 0, 0
    for idx in sorted(folder.glob("*.idx")):
        prefix = str(idx.with_suffix(""))
        ds = IndexedDataset(prefix)
        prefixes.append(prefix)
        docs += len(ds)
        tokens += int(ds.sequence_lengths.sum())
    return {"prefixes": prefixes, "documents": docs, "tokens": tokens}


def blend_string(prefixes: list[str]) -> str:
    """Megatron's --data-path form ('1.0 prefix ...'); equal weights, megatron weights by size itself."""
    return " ".join(f"1.0 {p}" for p in prefixes)


def data_dir(cfg: PipelineConfig) -> Path:
    return Path(cfg.workdir).resolve() / "data" / cfg.stage_hash("data", "tokenizer")


def prepare_data(cfg: PipelineConfig) -> dict:
    """Run data prep for `cfg` (or reuse a finished run) and return its manifest."""
    out = data_dir(cfg)
    manifest_path = out / MANIFEST
    if manifest_path.exists():
        return json.loads(manifest_path.read_text())
    if out.exists():  # an interrupted earlier run: start this stage over, cleanly
        shutil.rmtree(out)
    out.mkdir(parents=True)
    start = time.time()
    paths = resolve_inputs(cfg.data.inputs)
    tok = prepare_tokenizer(cfg, paths, out / "tokenizer")
    splits = {}
    for split in SPLITS:
        _tokenize_split(cfg, paths, tok, out, split)
        splits[split] = _split_stats(out / split)
        splits[split]["data_path"] = blend_string(splits[split]["prefixes"])
    for split in SPLITS:
        if splits[split]["documents"] == 0:
            raise DataPrepError(
                f"the {split} split is empty ({splits['train']['documents']} train / "
                f"{splits['valid']['documents']} valid documents): add data or change data.valid_fraction"
            )
    manifest = {
        "dir": str(out.resolve()),
        "hash": out.name,
        "inputs": [str(p) for p in paths],
        "tokenizer": tok.to_dict(),
        "splits": splits,
        "config": {"data": cfg.data.model_dump(mode="json"), "tokenizer": cfg.tokenizer.model_dump(mode="json")},
        "seconds": round(time.time() - start, 2),
    }
    tmp = manifest_path.with_suffix(".part")
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(manifest_path)
    return manifest
