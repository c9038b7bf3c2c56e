"""Instruction data (data.kind=instruction): records -> conversations -> packed tokens and their loss masks.

A record is a JSON line or a Parquet row holding either `messages` (a list of {role, content}, roles system, user,
assistant) or `prompt` and `response` (and optionally `system`); the field names are data.messages_key,
data.prompt_key, data.response_key and data.system_key. The readers turn each good record into one document whose
text is the conversation as compact JSON (the split, dedup and sharding then work on it as on any text), and
`InstructionWriter` renders it with the chat template (difflm.data_prep.chat) into one Megatron document of token
ids, P.bin/.idx, and beside it the same-length document of its loss mask, `loss_mask_prefix(P)`.bin/.idx (uint8:
1 on assistant content and the end-of-turn token, 0 elsewhere).

Bad records are skipped, counted per kind (`skipped_<kind>` in the manifest), and never lost from view: the first
record of each kind in each task is written to `logs/rejects/` (file and line or row, and why), and data prep's
summary prints one line per kind naming the first one. The kinds: `no_conversation` (neither messages nor
prompt/response), `malformed_messages` (messages is not a list of objects), `unknown_role`, `empty_content`,
`no_assistant_turn`, `template_error` (the chat template failed, or cannot be cut into turns), besides the kinds
every reader has (malformed JSON, invalid UTF-8, ...).

Both files of a shard are written by the same task and closed together: a task killed before its completion
marker is rerun whole, rewriting both, so a resumed prep keeps them consistent (verify checks it).
"""

from __future__ import annotations

import json
import os
import unicodedata
from typing import Literal

import pyarrow.parquet as pq
from datatrove.data import Document, DocumentsPipeline
from datatrove.io import get_datafolder
from datatrove.pipeline.readers.base import BaseDiskReader
from datatrove.pipeline.tokens.megatron_tokenizer import MegatronTokenizedFile
from datatrove.utils.batching import batched
from datatrove.utils.logging import logger

from difflm.data_prep.chat import ROLES, ChatFormat, TemplateError, TemplateSpec
from difflm.data_prep.readers import _SUFFIXES, JsonlSource
from difflm.data_prep.sharding import Piece
from difflm.data_prep.split import split_of
from difflm.data_prep.steps import SplitSourceWriter
from difflm.data_prep.tolerant import _kind, _TolerantMixin
from difflm.manifest import loss_mask_prefix

REJECTS = "logs/rejects"  # one JSON per (task, kind): the first record of that kind the task skipped
# what to do about each kind of bad record, for the summary's line of that kind
ADVICE = {
    "no_conversation": "give each record `messages` or `prompt` and `response` (or set data.messages_key / "
    "data.prompt_key / data.response_key to your field names)",
    "malformed_messages": "make `messages` a list of {role, content} objects",
    "unknown_role": f"use the roles {', '.join(ROLES)}",
    "empty_content": "give every turn some text",
    "no_assistant_turn": "give every conversation at least one assistant turn (a response)",
    "template_error": "fix the record, or set data.chat_template=plain",
}


def record_messages(record: dict, keys: dict[str, str | None]) -> tuple[list[dict[str, str]] | None, str, str]:
    """(messages, "", "") of a good record, else (None, kind, detail): the conversation a record holds, checked."""
    mkey, pkey, rkey, skey = keys["messages"], keys["prompt"], keys["response"], keys["system"]
    if mkey and record.get(mkey) is not None:
        raw = record[mkey]
        if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
            return None, "malformed_messages", f"(field {mkey!r} is {_kind(raw)}, not a list of objects)"
        turns = [(m.get("role"), m.get("content")) for m in raw]
    elif pkey and record.get(pkey) is not None:
        sys_text = record.get(skey) if skey else None
        turns = [("system", sys_text)] if sys_text is not None else []
        turns.append(("user", record[pkey]))
        if rkey and record.get(rkey) is not None:
            turns.append(("assistant", record[rkey]))
    else:
        fields = sorted(record)[:8]
        return None, "no_conversation", f"(no field {mkey!r}, nor {pkey!r} and {rkey!r}; fields: {fields})"
    messages = []
    for i, (role, content) in enumerate(turns):
        if role not in ROLES:
            return None, "unknown_role", f"(turn {i} has role {role!r}; known: {', '.join(ROLES)})"
        if not isinstance(content, str) or not content.strip():
            what = repr(content) if isinstance(content, str) else _kind(content)
            return None, "empty_content", f"(turn {i}, {role}: content is {what})"
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        return None, "no_assistant_turn", f"({len(messages)} turns, none of them the assistant's)"
    return messages, "", ""


def conversation_text(messages: list[dict[str, str]]) -> str:
    """A conversation as one document text: compact JSON, so that equal conversations are equal texts."""
    return json.dumps(messages, ensure_ascii=False, separators=(",", ":"))


class _InstructionMixin(_TolerantMixin):
    """A reader's records read as conversations: `_usable_text` checks the record and gives its conversation text;
    each skipped kind's first record is also written to the rejects folder."""

    keys: dict[str, str | None] = {}
    normalization: Literal["NFC", "NFKC"] | None = None  # data.unicode_normalization, applied to each turn's text
    source = ""  # the source's label (set by the reader's constructor)
    rejects_dir: str | None = None

    def _usable_text(self, record: dict, where: str) -> str | None:
        messages, kind, detail = record_messages(record, self.keys)
        if messages is None:
            self._skip(kind, where, detail)
            return None
        for m in messages:
            content = self._repaired(m["content"], lenient_json=True)
            if self.normalization:
                normal = unicodedata.normalize(self.normalization, content)
                if normal != content:
                    self._count("normalized")
                content = normal
            m["content"] = content
        return conversation_text(messages)

    def _skip(self, reason: str, where: str, detail: str = "", n: int = 1) -> None:
        super()._skip(reason, where, detail, n)
        if n and self._counting and self.rejects_dir:
            save_reject(self.rejects_dir, self._rank, reason, where, detail, self.source)

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        self._rank = rank
        yield from super().run(data, rank, world_size)


def save_reject(folder: str, rank: int, kind: str, where: str, detail: str, source: str) -> None:
    """The first record of `kind` this task skipped, written once (atomically: a task can be killed anywhere);
    `where` is relative to its source's folder."""
    path = os.path.join(folder, f"{rank:05d}-{kind}.json")
    if os.path.exists(path):
        return
    os.makedirs(folder, exist_ok=True)
    with open(path + ".part", "w") as f:
        json.dump({"kind": kind, "where": where, "detail": detail, "source": source}, f)
    os.replace(path + ".part", path)


class InstructionJsonlSource(_InstructionMixin, JsonlSource):
    """JSON lines of instruction records (every JSONL feature: compression, byte ranges, bad-line accounting)."""

    name = "🐿 Jsonl instructions"


class InstructionParquetSource(_InstructionMixin, BaseDiskReader):
    """Parquet rows of instruction records: the conversation columns only, in batches of `batch_rows` rows."""

    name = "📒 Parquet instructions"
    batch_rows = 256

    def __init__(self, data_folder, glob_pattern: str | None = None, source: str = "", **kwargs):
        super().__init__(data_folder, glob_pattern=glob_pattern, **kwargs)
        self.source = source

    def _records(self, piece: Piece) -> DocumentsPipeline:
        filepath = piece.path
        with self.data_folder.open(filepath, "rb") as f, pq.ParquetFile(f, buffer_size=1 << 20) as pqf:
            names = pqf.schema_arrow.names
            columns = [k for k in self.keys.values() if k and k in names]
            if not columns:  # every row is the same bad record: one count of them all, no row read
                detail = (
                    f"(no field {self.keys['messages']!r}, nor {self.keys['prompt']!r}; fields: {sorted(names)[:8]})"
                )
                self._skip("no_conversation", f"{filepath} row 0", detail, n=pqf.metadata.num_rows)
                return
            row = 0
            for batch in pqf.iter_batches(batch_size=self.batch_rows, columns=columns):
                for record in batch.to_pylist():
                    where = f"{filepath} row {row}"
                    row += 1
                    text = self._usable_text(record, where)
                    if text is not None:
                        yield Document(text=text, id=f"{self.source}:{where}", metadata={"source": self.source})


def make_instruction_reader(path, fmt: str, source: str, keys: dict, progress: bool = False):
    """The reader step of one instruction source (JSONL or Parquet)."""
    folder, glob = (path, None) if path.is_dir() else (path.parent, path.name)
    if fmt == "jsonl":
        reader = InstructionJsonlSource(str(folder), glob_pattern=glob or "**/*.json*", source=source)
    elif fmt == "parquet":
        reader = InstructionParquetSource(str(folder), glob_pattern=glob or "**/*.parquet", source=source)
    else:
        raise ValueError(f"instruction data is read from JSONL or Parquet files, not {fmt}")
    if glob is None:  # a folder: its files of other formats are listed by unknown_files, not read
        reader.patterns = _SUFFIXES[fmt]
    reader.keys, reader.doc_progress = keys, progress
    return reader


class InstructionWriter(SplitSourceWriter):
    """Render each conversation with the chat template and write its tokens and its loss mask, one document each,
    to `<split>/<source>/<rank>_tokens` and its `loss_mask_prefix`. A conversation the template cannot render is
    a counted skip (`skipped_template_error`), named in the task log and the rejects."""

    name = "✍️ instruction writer"

    def __init__(self, *args, template: dict, rejects_dir: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.template, self.rejects_dir = template, rejects_dir

    def _write(self, data: DocumentsPipeline, rank: int) -> None:
        chat = ChatFormat(TemplateSpec.from_dict(self.template), self.tokenizer_file, self.eos_token, self.mask_token)
        token_size = 4 if chat.tok.get_vocab_size() > 65536 else 2
        folder = get_datafolder(self.output_folder)
        writers: dict[tuple[str, str], tuple[MegatronTokenizedFile, MegatronTokenizedFile]] = {}
        for batch in batched(data, self.batch_size):
            for doc in batch:
                try:
                    with self.track_time(unit="document"):
                        ids, mask = chat.encode(json.loads(doc.text))
                except TemplateError as err:
                    self._reject(rank, doc, str(err))
                    continue
                split = split_of(doc.text, self.valid_fraction, self.salt, self.test_fraction)
                key = (split, doc.metadata.get("source", "data"))
                if key not in writers:
                    prefix = f"{split}/{key[1]}/{rank:05d}_tokens"
                    writers[key] = (
                        MegatronTokenizedFile(folder, prefix, token_size=token_size),
                        MaskFile(folder, loss_mask_prefix(prefix)),
                    )
                writers[key][0].write(ids)
                writers[key][1].write(mask)
                self.stat_update(f"{split}.documents")
                self.stat_update(f"{split}.tokens", value=len(ids))
                self.stat_update(f"{split}.scored_tokens", value=sum(mask))
        for tokens, masks in writers.values():
            tokens.close()
            masks.close()

    def _reject(self, rank: int, doc: Document, why: str) -> None:
        self.stat_update("skipped_template_error")
        where = doc.id.split(":", 1)[1] if ":" in doc.id else doc.id
        logger.warning(f"skipping record at {where}: template error ({why})")
        if self.rejects_dir:
            save_reject(self.rejects_dir, rank, "template_error", where, f"({why})", doc.metadata.get("source", ""))


class MaskFile(MegatronTokenizedFile):
    """A Megatron IndexedDataset of uint8 (dtype code 1): the loss mask beside a token shard."""

    def __init__(self, folder, filename: str):
        super().__init__(folder, filename, token_size=1)
        self.token_dtype, self.token_dtype_code = "uint8", 1


def reject_lines(rejects_dir, skipped: dict[str, int], folders: dict[str, str]) -> list[str]:
    """One line per kind of skipped record: how many, the first one (file and line or row, in the source's folder
    `folders[source]`) and what to do."""
    first: dict[str, dict] = {}
    for path in sorted(rejects_dir.glob("*.json")) if rejects_dir.exists() else ():
        r = json.loads(path.read_text())
        first.setdefault(r["kind"], r)  # the lowest task's: task order is input order
    lines = []
    for key, n in sorted(skipped.items()):
        kind = key.removeprefix("skipped_")
        if not key.startswith("skipped_") or key.endswith("_file") or not n:
            continue
        r = first.get(kind)
        where = r and os.path.join(folders.get(r.get("source", ""), ""), r["where"])
        at = f", the first at {where} {r['detail']}".rstrip() if r else ""
        advice = ADVICE.get(kind)
        lines.append(
            f"data prep: skipped {n} record(s): {kind.replace('_', ' ')}{at}" + (f"; {advice}" if advice else "")
        )
    return lines
