"""A unique-data budget (`data.unique_tokens`): a fixed subset of about N tokens of the training split, cut from a
finished data prep and written once as Megatron shards of its own.

The documents of the training split (every shard of every source) are ordered by a hash of their token ids salted
with `data.subset_seed`, and taken in that order while the subset holds fewer than N tokens: it ends within one
document above N. The order depends only on the documents, not on the shards or the number of prep tasks, so the
subset is the same for any prep of the same data, and a smaller budget is a prefix of a larger one (nested budgets).
Each source's documents are written in that order to `train/<source>/00000_tokens.bin/.idx` with the writer data
prep uses; the held-out splits are not copied: the subset's manifest names the prep's own shards, so every budget
is scored on the same held-out tokens.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from datatrove.pipeline.tokens.megatron_tokenizer import MegatronTokenizedFile

from difflm.data_prep.verify import read_index

SHARD = "00000_tokens"  # the one shard per source of a subset


def _tokens(prefix: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token ids, sequence lengths, first-token offsets) of one shard."""
    dtype, lengths, pointers, _ = read_index(Path(prefix + ".idx"))
    size = int(lengths.astype(np.int64).sum())
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r", shape=(size,)) if size else np.zeros(0, dtype)
    return tokens, lengths.astype(np.int64), pointers // dtype.itemsize


def document_order(prefixes: list[str], seed: int) -> list[tuple[bytes, int, int, int]]:
    """Every document of the shards as (salted hash of its token ids, shard number, document number, tokens),
    in hash order."""
    salt = f"{seed}\x00".encode()
    docs = []
    for shard, prefix in enumerate(prefixes):
        tokens, lengths, starts = _tokens(prefix)
        for doc, (start, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
            digest = hashlib.blake2b(salt + tokens[start : start + n].tobytes(), digest_size=8).digest()
            docs.append((digest, shard, doc, n))
    docs.sort()
    return docs


def _taken(order: list[tuple[bytes, int, int, int]], unique_tokens: int) -> list[tuple[bytes, int, int, int]]:
    """The first documents of `order` while the subset holds fewer tokens than the budget."""
    chosen, total = [], 0
    for entry in order:
        if total >= unique_tokens:
            break
        chosen.append(entry)
        total += entry[3]
    return chosen


def select(order: list[tuple[bytes, int, int, int]], unique_tokens: int) -> list[tuple[int, int]]:
    """(shard, document) of the documents a budget of `unique_tokens` takes: the first ones of `order` while the
    subset holds fewer tokens than the budget."""
    return [(shard, doc) for _, shard, doc, _ in _taken(order, unique_tokens)]


def subset_tokens(order: list[tuple[bytes, int, int, int]], unique_tokens: int) -> int:
    """The tokens of the subset `select` takes, without writing it: the budget rounded up to whole documents."""
    return sum(n for *_, n in _taken(order, unique_tokens))


def write_subset(prefixes: list[str], chosen: list[tuple[int, int]], out: Path, token_bytes: int) -> None:
    """The chosen documents, in their order, into one shard per source (`out/train/<source>/`, the source being
    the folder of the prep's shard, as in the prep's own layout)."""
    loaded: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    writers: dict[str, MegatronTokenizedFile] = {}
    for shard, doc in chosen:
        if shard not in loaded:
            loaded[shard] = _tokens(prefixes[shard])
        tokens, lengths, starts = loaded[shard]
        source = Path(prefixes[shard]).parent.name
        if source not in writers:
            writers[source] = MegatronTokenizedFile(str(out), f"train/{source}/{SHARD}", token_size=token_bytes)
        writers[source].write(tokens[starts[doc] : starts[doc] + lengths[doc]])
    for writer in writers.values():
        writer.close()
