"""Instruction data for the training tests, written the way data prep writes it (token shards P.bin/.idx and the
loss mask P_loss_mask.bin/.idx beside them, a manifest of kind "instruction"), with ids that say what they are:
a conversation starts with START, a prompt token is in PROMPT_IDS, a response token in RESPONSE_IDS, and every
assistant turn ends with EOS (scored), as data prep's plain template ends it. So a window's response mask and its
conversations can be checked against its tokens."""

from __future__ import annotations

from pathlib import Path

import numpy
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from difflm.manifest import DataManifest, SplitStats, loss_mask_prefix

START = 5  # the first token of every conversation (a template token, not scored)
PROMPT_IDS = range(10, 100)
RESPONSE_IDS = range(100, 200)


def conversation(g: numpy.random.Generator, eos_id: int) -> tuple[list[int], list[int]]:
    """(tokens, mask) of one conversation of one or two turns: START, then per turn prompt, response, EOS."""
    tokens: list[int] = [START]
    mask: list[int] = [0]
    turns = int(g.integers(1, 3))
    for _ in range(turns):
        prompt = g.integers(PROMPT_IDS.start, PROMPT_IDS.stop, int(g.integers(3, 9))).tolist()
        answer = g.integers(RESPONSE_IDS.start, RESPONSE_IDS.stop, int(g.integers(2, 7))).tolist()
        answer.append(eos_id)
        tokens += prompt + answer
        mask += [0] * len(prompt) + [1] * len(answer)
    return tokens, mask


def is_response(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """The mask a window of this data must carry, read from its ids."""
    return (tokens >= RESPONSE_IDS.start) & (tokens < RESPONSE_IDS.stop) | tokens.eq(eos_id)


def conversations(tokens: torch.Tensor) -> torch.Tensor:
    """[b, s] the conversation of each token of windows [b, s], numbered 0, 1, ... along each row."""
    starts = tokens.eq(START).long()
    starts[:, 0] = 0
    return starts.cumsum(-1)


def write_instruction_data(folder: Path, like: DataManifest, documents=(60, 12), seed: int = 0) -> DataManifest:
    """Train and valid shards of `documents` conversations under `folder`, with `like`'s tokenizer: their manifest."""
    folder.mkdir(parents=True, exist_ok=True)
    g = numpy.random.default_rng(seed)
    eos = like.tokenizer.eos_id
    splits = {}
    for split, n in zip(("train", "valid"), documents):
        prefix = str(folder / f"{split}_00000")
        tokens = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
        masks = IndexedDatasetBuilder(loss_mask_prefix(prefix) + ".bin", dtype=numpy.uint8)
        count = 0
        for _ in range(n):
            ids, mask = conversation(g, eos)
            tokens.add_document(torch.tensor(ids), [len(ids)])
            masks.add_document(torch.tensor(mask), [len(mask)])
            count += len(ids)
        tokens.finalize(prefix + ".idx")
        masks.finalize(loss_mask_prefix(prefix) + ".idx")
        splits[split] = SplitStats(n, count, prefixes=(prefix,), weights=(1.0,), data_path=f"1.0 {prefix}")
    splits["test"] = SplitStats(0, 0)
    return like.replace(dir=str(folder), hash="i" * 12, splits=splits, kind="instruction", sources=())
