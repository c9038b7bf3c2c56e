"""The check's own data: a pre-tokenised synthetic corpus from a sparse Markov chain (4 successors per token),
so that the loss has somewhere to fall and a sample can be judged by how many of its token pairs the chain
allows. Documents have varied lengths (drawn in plan's `doc_len` range), so packed windows at long context hold
many documents and document masks do real work. `dominant`: the first successor's probability (the rest share
what is left): a corpus a model can be confident on (threshold decoding needs probabilities above 0.25).

numpy, torch, megatron and the tokenizers are imported inside the functions: this module is imported before the
wheels' install (benchmarks/gpu/runtime.py).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from difflm.manifest import DataManifest, SplitStats, TokenizerInfo  # standard library only: loads before the install

SPECIALS = ["<|endoftext|>", "<|mask|>", "<|pad|>"]
SUCCESSORS = 4


def markov_table(vocab: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(len(SPECIALS), vocab, size=(vocab, SUCCESSORS))


def successor_probabilities(dominant: float | None):
    """The chance of each of the SUCCESSORS: equal, or the first at `dominant` and the rest equal."""
    if dominant is None:
        return [1 / SUCCESSORS] * SUCCESSORS
    if not 1 / SUCCESSORS <= dominant < 1:
        raise ValueError(f"dominant successor probability {dominant} must be in [{1 / SUCCESSORS}, 1)")
    return [dominant] + [(1 - dominant) / (SUCCESSORS - 1)] * (SUCCESSORS - 1)


def markov_documents(p: dict, table, seed: int = 1, dominant: float | None = None) -> list:
    """p["documents"] chains of lengths drawn uniformly in p["doc_len"] ([low, high]); chains advance together,
    one column a step, then each is cut to its length."""
    import numpy as np

    rng = np.random.default_rng(seed)
    low, high = p["doc_len"]
    lengths = rng.integers(low, high + 1, size=p["documents"])
    docs = np.empty((p["documents"], int(lengths.max())), dtype=np.int64)
    docs[:, 0] = rng.integers(len(SPECIALS), len(table), size=p["documents"])
    probs = successor_probabilities(dominant)
    for j in range(1, docs.shape[1]):
        docs[:, j] = table[docs[:, j - 1], rng.choice(SUCCESSORS, size=p["documents"], p=probs)]
    return [row[:n] for row, n in zip(docs, lengths)]


def make_dataset(p: dict, folder: Path, dominant: float | None = None) -> DataManifest:
    """Megatron .bin/.idx train and valid splits + an HF tokenizer folder; returns the data manifest (also written
    to `folder`/manifest.json, what the workers read)."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    vocab, table = p["vocab"], markov_table(p["vocab"])
    docs = markov_documents(p, table, dominant=dominant)
    tok_dir = folder / "tokenizer"
    tok_sha = save_tokenizer(vocab, tok_dir)
    splits = {}
    n_valid = max(2, p["documents"] // 20)
    for split, rows in (("valid", docs[:n_valid]), ("train", docs[n_valid:])):
        prefix = folder / split / "00000_tokens"
        prefix.parent.mkdir(parents=True, exist_ok=True)
        builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
        for row in rows:
            builder.add_document(torch.from_numpy(np.append(row, 0).astype(np.int64)), [len(row) + 1])
        builder.finalize(f"{prefix}.idx")
        splits[split] = SplitStats(
            documents=len(rows), tokens=int(sum(len(r) + 1 for r in rows)), prefixes=(str(prefix),), weights=(1.0,)
        )
    splits["test"] = SplitStats(documents=0, tokens=0)
    manifest = DataManifest(
        dir=str(folder),
        hash=hashlib.sha256(tok_sha.encode()).hexdigest()[:12],
        tokenizer=TokenizerInfo(
            path=str(tok_dir), vocab_size=vocab, eos_id=0, mask_id=1, pad_id=2, sha256=tok_sha, special_ids=(0, 1, 2)
        ),
        token_bytes=2,
        splits=splits,
    )
    manifest.write(folder / "manifest.json")
    np.save(folder / "markov.npy", table)
    return manifest


def save_tokenizer(vocab: int, folder: Path) -> str:
    """A word-level tokenizer whose tokens are w3 .. w{vocab-1}: samples decode to readable ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {s: i for i, s in enumerate(SPECIALS)} | {f"w{i}": i for i in range(len(SPECIALS), vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=SPECIALS[0], mask_token=SPECIALS[1], pad_token=SPECIALS[2]
    ).save_pretrained(str(folder))
    return hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()


def chain_fraction(tokens, table) -> float:
    """Share of adjacent pairs (a, b) the Markov chain allows: ~1 for a model that learnt it, ~4/V for noise."""
    pairs = [(a, b) for a, b in zip(tokens[:-1], tokens[1:]) if a >= len(SPECIALS) and b >= len(SPECIALS)]
    return sum(b in table[a] for a, b in pairs) / max(len(pairs), 1)
