"""datatrove pipeline steps of our own: hash sharding, cleaning filters, and the split/source writer."""

from __future__ import annotations

import hashlib
import os
import unicodedata

from datatrove.data import Document, DocumentsPipeline
from datatrove.io import get_datafolder
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.pipeline.tokens.megatron_tokenizer import MegatronTokenizedFile
from datatrove.utils.batching import batched
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

from difflm.data_prep.split import split_of


def text_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


class HashShard(PipelineStep):
    """Keep the documents of this task: text hash modulo the number of tasks (content-defined)."""

    name = "🧮 hash shard"

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        for doc in data:
            if text_hash(doc.text) % world_size == rank:
                yield doc


class UnicodeNormalizer(PipelineStep):
    """Unicode normalisation (NFC/NFKC); counts the documents it changed."""

    name = "🔤 unicode"

    def __init__(self, form: str):
        super().__init__()
        self.form = form

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        for doc in data:
            normalized = unicodedata.normalize(self.form, doc.text)
            if normalized != doc.text:
                self.stat_update("normalized")
                doc.text = normalized
            yield doc


class LengthFilter(BaseFilter):
    """Drop empty/whitespace-only documents always; too short/long ones when bounds are set."""

    name = "📏 length"

    def __init__(self, min_chars: int = 0, max_chars: int | None = None):
        super().__init__()
        self.min_chars, self.max_chars = min_chars, max_chars

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        n = len(doc.text.strip())
        if n == 0:
            return False, "empty"
        if n < self.min_chars:
            return False, "too_short"
        if self.max_chars is not None and n > self.max_chars:
            return False, "too_long"
        return True


class ExactDedup(BaseFilter):
    """Drop exact duplicates of an earlier document. Global because HashShard sends identical texts to
    the same task; the first copy in input order is kept, so the result is deterministic."""

    name = "🫂 exact dedup"

    def __init__(self):
        super().__init__()
        self._seen: set[bytes] = set()

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        key = hashlib.blake2b(doc.text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        if key in self._seen:
            return False, "duplicate"
        self._seen.add(key)
        return True


class SplitSourceWriter(PipelineStep):
    """Tokenize (EOS appended) and write one Megatron .bin/.idx per (split, source) for this task.

    Uses datatrove's MegatronTokenizedFile, whose output is byte-identical to megatron-core's builder.
    Token width (2 or 4 bytes) follows the vocabulary size. A document whose text holds the literal
    `mask_token` (a reused special token such as SmolLM2's `<empty_output>` occurs in real notebooks) is encoded
    with special tokens split into plain text: the mask id never enters the clean data.

    Cost beside the tokenizer: one `encode_batch_fast` call per batch (no character offsets, which nothing here
    uses), statistics updated once per batch, and `threads` tokenizer threads per task (several local workers
    share the cores instead of each starting one thread per core).
    """

    name = "✍️ split/source writer"
    type = "🔢 - TOKENIZER"

    def __init__(
        self,
        output_folder: str,
        tokenizer_file: str,
        eos_token: str,
        valid_fraction: float,
        test_fraction: float,
        salt: int,
        batch_size: int = 512,
        mask_token: str | None = None,
        threads: int | None = None,
    ):
        super().__init__()
        self.output_folder, self.tokenizer_file, self.eos_token = output_folder, tokenizer_file, eos_token
        self.mask_token = mask_token
        self.valid_fraction, self.test_fraction, self.salt = valid_fraction, test_fraction, salt
        self.batch_size = batch_size
        self.threads = threads

    def _tokenizer(self, split_special: bool = False) -> Tokenizer:
        tok = Tokenizer.from_file(self.tokenizer_file)
        eos_id = tok.token_to_id(self.eos_token)
        tok.post_processor = TemplateProcessing(
            single=f"$A {self.eos_token}", special_tokens=[(self.eos_token, eos_id)]
        )
        tok.encode_special_tokens = split_special  # True: special tokens in the text are plain text
        return tok

    def _encode(self, tok: Tokenizer, plain: Tokenizer, texts: list[str]) -> list[list[int]]:
        """Token ids of each text; texts holding the mask's literal string go through `plain`."""
        ids = [enc.ids for enc in tok.encode_batch_fast(texts)]
        if self.mask_token:
            for i, text in enumerate(texts):
                if self.mask_token in text:
                    ids[i] = plain.encode(text).ids
                    self.stat_update("mask_literal.documents")
        return ids

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        if self.threads:  # read once, when the tokenizer's thread pool starts (the first batch of this process)
            os.environ["RAYON_NUM_THREADS"] = str(self.threads)
        # the CLI turns the tokenizer's threads off for the whole process (OFFLINE_ENV); the writer needs them
        before = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "true"
        try:
            self._write(data, rank)
        finally:
            if before is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = before
        return
        yield  # a generator step that ends the pipeline

    def _write(self, data: DocumentsPipeline, rank: int) -> None:
        tok, plain = self._tokenizer(), self._tokenizer(split_special=True)
        token_size = 4 if tok.get_vocab_size() > 65536 else 2
        folder = get_datafolder(self.output_folder)
        writers: dict[tuple[str, str], MegatronTokenizedFile] = {}
        for batch in batched(data, self.batch_size):
            with self.track_time(unit="batch"):
                encoded = self._encode(tok, plain, [d.text for d in batch])
            counts: dict[str, int] = {}
            for doc, ids in zip(batch, encoded):
                split = split_of(doc.text, self.valid_fraction, self.salt, self.test_fraction)
                key = (split, doc.metadata.get("source", "data"))
                if key not in writers:
                    writers[key] = MegatronTokenizedFile(
                        folder, f"{split}/{key[1]}/{rank:05d}_tokens", token_size=token_size
                    )
                writers[key].write(ids)
                counts[f"{split}.documents"] = counts.get(f"{split}.documents", 0) + 1
                counts[f"{split}.tokens"] = counts.get(f"{split}.tokens", 0) + len(ids)
            for name, n in counts.items():
                self.stat_update(name, value=n, unit="batch")
        for w in writers.values():
            w.close()
