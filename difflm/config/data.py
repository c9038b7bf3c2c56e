"""The data sections: the sources, data preparation, the tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from difflm.config.base import IF_SET, _Section
from difflm.config.launch import SlurmConfig

# generated conversations, instruction data only: the mix and each task alone (data_prep.instruction_tasks.SOURCES,
# spelt here as the config imports no data prep; tests/unit/data_prep/test_chat.py checks that they agree)
INSTRUCTION_SOURCES = (
    "demo:instructions",
    *(f"demo:instructions-{t}" for t in ("copy", "reverse", "last", "add")),
)

# the manifest's kinds (difflm.manifest.DataKind): spelt here too, as the config package imports no runtime module;
# tests/unit/test_manifest.py checks that the two agree
DataKind = Literal["pretraining", "instruction"]


class SourceConfig(_Section):
    path: str = Field(
        description="'demo:enwiki', a file, or a folder (JSONL[.gz|.zst], Parquet, .txt, saved HF dataset)."
    )
    format: Literal["auto", "jsonl", "parquet", "text", "hf_disk"] = "auto"
    text_key: str | None = Field(None, description="Field with the text (None: data.text_key).")
    weight: float | None = Field(
        None,
        gt=0.0,
        description="Share of this source in training (None: in proportion to its tokens, "
        "if every source leaves it unset; otherwise 1).",
    )
    name: str | None = Field(None, description="Name in outputs and the manifest (None: from the path).")

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.path.startswith("demo:"):
            return self.path.split(":", 1)[1]
        return Path(self.path.rstrip("/")).name.split(".")[0] or "data"


class DataConfig(_Section):
    kind: DataKind = Field(
        "pretraining",
        json_schema_extra=IF_SET,
        description="pretraining: documents to pack; instruction: conversations (`messages`, or `prompt` and "
        "`response`) rendered with a chat template, with a loss mask beside the tokens (docs/data.md).",
    )
    chat_template: Literal["auto", "tokenizer", "plain"] = Field(
        "auto",
        json_schema_extra=IF_SET,
        description="Instruction data: the tokenizer's own chat template (tokenizer), ours (plain: 'User: ...\\n"
        "Assistant: ...<eos>'), or the tokenizer's when it has one (auto).",
    )
    messages_key: str = Field("messages", json_schema_extra=IF_SET, description="Instruction data: the turns' field.")
    prompt_key: str = Field("prompt", json_schema_extra=IF_SET, description="Instruction data: the prompt's field.")
    response_key: str = Field(
        "response", json_schema_extra=IF_SET, description="Instruction data: the response's field."
    )
    system_key: str = Field(
        "system", json_schema_extra=IF_SET, description="Instruction data: an optional system prompt's field."
    )
    sources: list[SourceConfig] = Field(
        default_factory=lambda: [SourceConfig(path="demo:enwiki")],
        description="Inputs; a plain string is a path with defaults.",
    )
    text_key: str = Field("text", description="Default field holding the document text.")
    max_documents: int | None = Field(None, ge=1, description="Read at most this many documents per source.")
    min_chars: int = Field(0, ge=0, description="Drop documents shorter than this (0: off; empty ones always go).")
    max_chars: int | None = Field(None, ge=1, description="Drop documents longer than this (None: off).")
    dedup: bool = Field(False, description="Remove exact-duplicate documents.")
    strict: bool = Field(
        False,
        description="Fail on a damaged or unreadable input file (truncated/corrupt .gz/.zst, I/O error) "
        "instead of keeping its readable records; reads every input once more, up front, before any work.",
    )
    unicode_normalization: Literal["NFC", "NFKC"] | None = Field(None, description="Normalise text (None: off).")
    valid_fraction: float = Field(0.05, ge=0.0, lt=0.5, description="Share of documents held out for validation.")
    test_fraction: float = Field(0.0, ge=0.0, lt=0.5, description="Share of documents held out for test.")
    split_seed: int = Field(0, description="Salt of the document hash that assigns splits.")
    unique_tokens: int | None = Field(
        None,
        ge=1,
        json_schema_extra=IF_SET,  # None trains on the whole split, as every run before it did
        description="Unique-data budget: train on a fixed subset of about this many tokens of the training split "
        "(whole documents in the order of a salted hash of their tokens, so a smaller budget is a subset of a "
        "larger one); the held-out splits are untouched. None: the whole training split.",
    )
    subset_seed: int = Field(
        0, json_schema_extra=IF_SET, description="Salt of the document hash that picks the data.unique_tokens subset."
    )
    tasks: int | None = Field(None, ge=1, description="Output shards per (split, source) (None: = workers).")
    workers: int = Field(1, ge=1, description="Parallel processes of the local executor.")
    executor: Literal["local", "slurm", "ray"] = "local"
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)

    @field_validator("sources", mode="before")
    @classmethod
    def _strings_are_paths(cls, v: Any) -> Any:
        if isinstance(v, (str, dict)):
            v = [v]
        return [{"path": x} if isinstance(x, str) else x for x in v]

    @model_validator(mode="after")
    def _unique_names(self) -> DataConfig:
        labels = [s.label for s in self.sources]
        if len(set(labels)) != len(labels):
            raise ValueError(f"data.sources: two sources share a name ({labels}); give each a distinct `name`")
        if not self.sources:
            raise ValueError("data.sources is empty: give at least one input")
        generated = [s.path for s in self.sources if s.path in INSTRUCTION_SOURCES]
        if generated and self.kind != "instruction":
            raise ValueError(f"data.sources: {generated[0]} is instruction data; set data.kind=instruction")
        if self.kind == "instruction" and self.unique_tokens is not None:
            raise ValueError("data.unique_tokens cuts pretraining data only; unset it for data.kind=instruction")
        return self

    @property
    def instruction_keys(self) -> dict[str, str | None]:
        """The field names of an instruction record."""
        return {
            "messages": self.messages_key,
            "prompt": self.prompt_key,
            "response": self.response_key,
            "system": self.system_key,
        }

    @property
    def num_tasks(self) -> int:
        return self.tasks or self.workers


class TokenizerConfig(_Section):
    path: str | None = Field(
        None, description="Local HF tokenizer folder or tokenizer.json; None trains a byte-level BPE on the corpus."
    )
    vocab_size: int = Field(4096, ge=300, description="Vocabulary size when training the BPE tokenizer.")
    mask_token: str = Field("<|mask|>", description="Token that masked diffusion corrupts to; must exist.")
    eos_token: str = Field("<|endoftext|>", description="Appended to every document.")
    pad_token: str = Field("<|pad|>")


# Architecture presets (`model.preset=125m`); fields set next to the preset override it. The GPU-sized ones
