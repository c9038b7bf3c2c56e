"""The data manifest: what data prep hands to every later stage, as one frozen, typed record.

data prep writes it (`manifest.json` in the data folder, `DataManifest.write`); a run copies it beside its
checkpoints (`data_manifest.json`, difflm.rundir); training, export, evaluation and tracking read it with
`DataManifest.read` / `DataManifest.load`. The JSON shape is the one data prep has written since the first
release: manifests written before this module existed load unchanged (tests/unit/test_manifest.py reads one),
and `to_dict()` writes the same keys back.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from difflm.errors import UserError

# pretraining: documents to pack; instruction: prompt/response pairs (the SFT stage's data)
DataKind = Literal["pretraining", "instruction"]
KINDS: tuple[str, ...] = ("pretraining", "instruction")


class ManifestError(UserError, ValueError):
    """A manifest file that cannot be read as one; the message names the file and what to do."""


@dataclass(frozen=True)
class TokenizerInfo:
    """What later stages need to know about the tokenizer: its folder, sizes, special ids and identity."""

    path: str  # folder with tokenizer.json (+ HF tokenizer_config.json)
    vocab_size: int
    eos_id: int
    mask_id: int
    pad_id: int
    sha256: str  # of tokenizer.json: the tokenizer's identity
    special_ids: tuple[int, ...] = ()  # never drawn as uniform noise

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenizerInfo:
        known = {f.name for f in fields(cls)}
        return cls(
            **{k: v for k, v in d.items() if k in known and k != "special_ids"},
            special_ids=tuple(d.get("special_ids") or ()),
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "special_ids": list(self.special_ids)}

    @property
    def json_file(self) -> str:
        return str(Path(self.path) / "tokenizer.json")


@dataclass(frozen=True)
class SplitStats:
    """One split (train, valid, test): its shards (Megatron prefixes), their blend weights and counts."""

    documents: int
    tokens: int
    prefixes: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()
    sources: dict[str, dict[str, int]] = field(default_factory=dict)  # per source: documents, tokens
    data_path: str = ""  # megatron's "w1 prefix1 w2 prefix2 ..." string

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SplitStats:
        return cls(
            documents=int(d["documents"]),
            tokens=int(d["tokens"]),
            prefixes=tuple(d.get("prefixes") or ()),
            weights=tuple(float(w) for w in d.get("weights") or ()),
            sources={k: dict(v) for k, v in (d.get("sources") or {}).items()},
            data_path=str(d.get("data_path", "")),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "documents": self.documents,
            "tokens": self.tokens,
            "sources": self.sources,
            "prefixes": list(self.prefixes),
            "weights": list(self.weights),
            "data_path": self.data_path,
        }


@dataclass(frozen=True)
class DataManifest:
    """A finished data-prep folder: `hash` names it (data + tokenizer settings), `dir` holds its shards."""

    dir: str
    hash: str
    tokenizer: TokenizerInfo
    splits: dict[str, SplitStats]
    token_bytes: int = 2
    kind: DataKind = "pretraining"
    sources: tuple[dict[str, Any], ...] = ()  # name, path, format, weight (+ provenance of an embedded corpus)
    skipped: dict[str, int] = field(default_factory=dict)  # records dropped, by reason
    file_problems: tuple[Any, ...] = ()
    config: dict[str, Any] = field(default_factory=dict)  # the data and tokenizer sections that made it
    seconds: float = 0.0
    budget: dict[str, Any] | None = None  # a data.unique_tokens subset: its budget and where it came from

    @property
    def unique_tokens(self) -> int:
        """Tokens in the training split: the unique tokens an epoch sees."""
        return self.splits["train"].tokens

    def split(self, name: str) -> SplitStats:
        if name not in self.splits:
            raise ManifestError(f"the data at {self.dir} has no {name!r} split (it has {sorted(self.splits)})")
        return self.splits[name]

    def replace(self, **changes: Any) -> DataManifest:
        return replace(self, **changes)

    # --- the one serialization -------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataManifest:
        kind = d.get("kind", "pretraining")
        if kind not in KINDS:
            raise ManifestError(f"manifest of {d.get('dir')}: kind {kind!r} is not one of {KINDS}")
        return cls(
            dir=str(d["dir"]),
            hash=str(d["hash"]),
            tokenizer=TokenizerInfo.from_dict(d["tokenizer"]),
            splits={k: SplitStats.from_dict(v) for k, v in d["splits"].items()},
            token_bytes=int(d.get("token_bytes", 2)),
            kind=kind,
            sources=tuple(d.get("sources") or ()),
            skipped=dict(d.get("skipped") or {}),
            file_problems=tuple(d.get("file_problems") or ()),
            config=dict(d.get("config") or {}),
            seconds=float(d.get("seconds", 0.0)),
            budget=d.get("budget"),
        )

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "dir": self.dir,
            "hash": self.hash,
            "kind": self.kind,
            "sources": list(self.sources),
            "tokenizer": self.tokenizer.to_dict(),
            "token_bytes": self.token_bytes,
            "splits": {k: v.to_dict() for k, v in self.splits.items()},
            "skipped": self.skipped,
            "file_problems": list(self.file_problems),
            "config": self.config,
            "seconds": self.seconds,
        }
        if self.budget is not None:
            d["budget"] = self.budget
        return d

    @classmethod
    def read(cls, path: str | Path) -> DataManifest:
        """A manifest file (data prep's manifest.json or a run's data_manifest.json), old or new."""
        path = Path(path)
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            raise ManifestError(f"no data manifest at {path}: run data prep first (difflm prep)") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            if isinstance(e, ManifestError):
                raise
            raise ManifestError(
                f"{path} is not a data manifest ({type(e).__name__}: {e}): delete its folder and rerun data prep"
            ) from None

    def write(self, path: str | Path) -> Path:
        """Write atomically: a half-written manifest never marks a folder done."""
        path = Path(path)
        tmp = path.with_suffix(".part")
        tmp.write_text(json.dumps(self.to_dict(), indent=2))
        tmp.replace(path)
        return path
