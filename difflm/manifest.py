"""The data manifest: what data prep hands to every later stage, as one frozen, typed record.

data prep writes it (`manifest.json` in the data folder, `DataManifest.write`); a run copies it beside its
checkpoints (`data_manifest.json`, difflm.rundir); training, export, evaluation and tracking read it with
`DataManifest.read`, and a Prefect result store hands the data-prep stage's stored result to `DataManifest.of`.
The JSON shape is the one data prep has written since the first release: manifests written before this module
existed load unchanged (tests/unit/test_manifest.py reads one), and `to_dict()` writes the same keys back.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args

from difflm.errors import UserError

# pretraining: documents to pack (all data prep writes today); instruction: prompt/response pairs, for fine-tuning
DataKind = Literal["pretraining", "instruction"]
KINDS: tuple[str, ...] = get_args(DataKind)


LOSS_MASK_SUFFIX = "_loss_mask"


def loss_mask_prefix(prefix: str) -> str:
    """The loss-mask shard beside the token shard `prefix` of instruction data: a Megatron IndexedDataset of uint8
    with the same sequence lengths and document indices, 1 where a token is scored (assistant turns and the
    end-of-turn token closing each), 0 elsewhere."""
    return prefix + LOSS_MASK_SUFFIX


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
        return cls(
            path=str(d["path"]),
            vocab_size=int(d["vocab_size"]),
            eos_id=int(d["eos_id"]),
            mask_id=int(d["mask_id"]),
            pad_id=int(d["pad_id"]),
            sha256=str(d["sha256"]),
            special_ids=tuple(int(i) for i in d.get("special_ids") or ()),
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
    # instruction data: the chat template (difflm.data_prep.chat.TemplateSpec.to_dict) and the record's field names
    instruction: dict[str, Any] | None = None

    @property
    def unique_tokens(self) -> int:
        """Tokens in the training split: the unique tokens an epoch sees."""
        return self.splits["train"].tokens

    @property
    def loss_masks(self) -> bool:
        """Whether every token shard has a loss-mask shard beside it (`loss_mask_prefix`): instruction data."""
        return self.kind == "instruction"

    def split(self, name: str) -> SplitStats:
        if name not in self.splits:
            raise ManifestError(f"the data at {self.dir} has no {name!r} split (it has {sorted(self.splits)})")
        return self.splits[name]

    def replace(self, **changes: Any) -> DataManifest:
        return replace(self, **changes)

    # --- the one serialization -------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "a data manifest") -> DataManifest:
        """The record of a manifest's JSON (any release's: keys added since have defaults); ManifestError naming
        `where` when it is not one."""
        try:
            kind = d.get("kind", "pretraining")  # written since manifests could hold instruction data
            if kind not in KINDS:
                raise ManifestError(
                    f"{where}: kind {kind!r} is not one of {', '.join(KINDS)}; it was not written by data prep: {_REDO}"
                )
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
                instruction=d.get("instruction"),
            )
        except KeyError as e:
            raise ManifestError(f"{where} has no {e.args[0]!r}: it is not a complete data manifest; {_REDO}") from None
        except (AttributeError, TypeError, ValueError) as e:
            if isinstance(e, ManifestError):
                raise
            raise ManifestError(f"{where} is not a data manifest ({type(e).__name__}: {e}); {_REDO}") from None

    def to_dict(self) -> dict[str, Any]:
        """The manifest's JSON: every key data prep wrote before this record existed, and `kind`."""
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
        if self.instruction is not None:
            d["instruction"] = self.instruction
        return copy.deepcopy(d)  # the record's own dicts stay its own: a caller may change what it gets

    @classmethod
    def read(cls, path: str | Path) -> DataManifest:
        """A manifest file (data prep's manifest.json or a run's data_manifest.json), old or new."""
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ManifestError(
                f"no data manifest at {path}: data prep writes it last, so its data is not prepared (or was "
                f"deleted); run data prep (difflm prep, or the pipeline) for this config"
            ) from None
        try:
            d = json.loads(text)
        except ValueError as e:  # JSONDecodeError, or bytes that are not text
            raise ManifestError(f"{path} is not JSON ({e}); {_REDO}") from None
        if not isinstance(d, dict):
            raise ManifestError(f"{path} holds a JSON {type(d).__name__}, not a data manifest; {_REDO}")
        return cls.from_dict(d, where=str(path))

    @classmethod
    def of(cls, value: DataManifest | dict[str, Any]) -> DataManifest:
        """The record itself, or the plain dict a Prefect result store holds from the release before it was typed
        (the data-prep stage's cached result), as `TrainResult.read` reads an old train result."""
        return value if isinstance(value, DataManifest) else cls.from_dict(value, where="a stored data-prep result")

    def write(self, path: str | Path) -> Path:
        """Write atomically: a half-written manifest never marks a folder done."""
        path = Path(path)
        tmp = path.with_suffix(".part")
        tmp.write_text(json.dumps(self.to_dict(), indent=2))
        tmp.replace(path)
        return path

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        """Read back through `from_dict` (what Prefect's JSON result store hands over: the stored data-prep
        result), written as `to_dict`: the record crosses the store in the one serialization."""
        # pydantic-core only here, where pydantic asks: this module stays on the standard library for everything else
        from pydantic_core import core_schema

        return core_schema.no_info_plain_validator_function(
            cls.of, serialization=core_schema.plain_serializer_function_ser_schema(lambda m: m.to_dict())
        )


_REDO = (
    "data prep writes manifest.json last: delete that data folder and run data prep again (a run's "
    "data_manifest.json is a copy of its data's manifest.json: copy it again)"
)
