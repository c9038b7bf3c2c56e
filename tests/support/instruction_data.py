"""Instruction data for the training tests, written the way data prep writes it (token shards P.bin/.idx and the
loss mask P_loss_mask.bin/.idx beside them, a manifest of kind "instruction"), with ids that say what they are:
a prompt token is in PROMPT_IDS, a response token in RESPONSE_IDS, an inner assistant turn ends with END_OF_TURN
and a conversation with EOS (both scored). So a window's response mask can be checked against its tokens."""

from __future__ import annotations

from pathlib import Path

import numpy
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from difflm.manifest import DataManifest, SplitStats, loss_mask_prefix

PROMPT_IDS = range(10, 100)
RESPONSE_IDS = range(100, 200)
END_OF_TURN = 200  # closes an assistant turn that is not the conversation's last (a template token, scored)


def conversation(g: numpy.random.Generator, eos_id: int) -> tuple[list[int], list[int]]:
    """(tokens, mask) of one conversation of one or two turns: prompt, response, end of turn (EOS at the end)."""
    tokens: list[int] = []
    mask: list[int] = []
    turns = int(g.integers(1, 3))
    for turn in range(turns):
        prompt = g.integers(PROMPT_IDS.start, PROMPT_IDS.stop, int(g.integers(3, 9))).tolist()
        answer = g.integers(RESPONSE_IDS.start, RESPONSE_IDS.stop, int(g.integers(2, 7))).tolist()
        answer.append(eos_id if turn == turns - 1 else END_OF_TURN)
        tokens += prompt + answer
        mask += [0] * len(prompt) + [1] * len(answer)
    return tokens, mask


def is_response(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """The mask a window of this data must carry, read from its ids."""
    return (tokens >= RESPONSE_IDS.start) & (tokens <= END_OF_TURN) | tokens.eq(eos_id)


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
