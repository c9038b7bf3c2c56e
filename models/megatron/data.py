"""Megatron datasets from a data-prep manifest, and the deterministic batch order of a run.

Samples are megatron GPTDatasets (packed, shuffled windows of seq_length+1 tokens) built by
megatron's BlendedMegatronDatasetBuilder. Sample k of a split is fixed by the seed, so the batch of
(iteration, micro-batch, data-parallel rank) is too: a resumed run sees exactly the data the
uninterrupted run would have seen.

Instruction data (`DataManifest.kind == "instruction"`) carries a loss mask beside every token shard
(`difflm.manifest.loss_mask_prefix`: the same documents, 1 on response tokens). Megatron picks a GPTDataset's
windows from the document lengths, the split and the seed only, so a GPTDataset built on the mask shards with the
same config holds, as its sample k, the mask of sample k's tokens: `ResponseDataset` reads both (the batch order
stays the seed's, deterministic and resumable) and `build_datasets` refuses mask shards whose documents differ.
The mask windows also carry where each document starts (`MaskDocuments`): a conversation is one document for the
packed-document attention, whatever EOS its template puts between turns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset

from difflm.config import PipelineConfig
from difflm.errors import UserError
from difflm.manifest import DataManifest, loss_mask_prefix


@dataclass
class DatasetTokenizer:
    """The few tokenizer facts megatron's GPTDataset reads."""

    vocab_size: int
    eod: int
    pad: int
    path: str = ""

    @property
    def unique_identifiers(self) -> dict:  # part of megatron's dataset cache key
        return {"class": "DatasetTokenizer", "path": self.path, "vocab_size": self.vocab_size}


# The mask windows' values are mask + 2 * (first token of a document) (`MaskDocuments`); their GPTDataset pads a
# short window with 0 (no response, no new document), and only their cache key reads the rest.
MASK_TOKENIZER = DatasetTokenizer(vocab_size=4, eod=0, pad=0, path="response-mask")


class MaskDocuments:
    """A loss-mask shard (IndexedDataset) whose values read as mask + 2 where a document (one conversation) starts:
    a window of it gives both the response mask and where each of its documents begins (a document's index would
    not do: at an epoch boundary the same conversation may follow itself). Everything else (the lengths the windows
    are drawn from) is the shard's own."""

    def __init__(self, indexed: IndexedDataset):
        self.indexed = indexed

    def __getattr__(self, name: str):
        return getattr(self.indexed, name)

    def __len__(self) -> int:
        return len(self.indexed)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> numpy.ndarray:
        values = self.indexed.get(idx, offset, length).astype(numpy.int64)
        if offset == 0 and len(values):  # the part of the window that holds the document's first token
            values[0] += 2
        return values


class MaskDocumentsGPTDataset(GPTDataset):
    """Megatron's GPTDataset over `MaskDocuments`: the same windows as the token shards' (same lengths, same seed)."""

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> MaskDocuments:
        return MaskDocuments(GPTDataset.build_low_level_dataset(dataset_path, config))


class ResponseDataset:
    """Instruction data: sample k of the token windows with `response` / `response_labels` [s] (bool), the mask
    of its tokens and of its labels, and `documents` [s] (its conversations, numbered 0, 1, ... along the window),
    read from sample k of the mask windows."""

    def __init__(self, tokens, masks):
        self.tokens, self.masks = tokens, masks

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, idx: int) -> dict:
        sample, mask = self.tokens[idx], self.masks[idx]
        values, next_values = mask["tokens"], mask["labels"]  # 0 where megatron padded the window
        starts = values.ge(2).long()
        starts[0] = 0  # the window's first token opens its first document, numbered 0
        return {
            **sample,
            "response": values.remainder(2).eq(1),
            "response_labels": next_values.remainder(2).eq(1),
            "documents": starts.cumsum(0),
        }


def build_datasets(cfg: PipelineConfig, manifest: DataManifest, train_samples: int, valid_samples: int):
    """(train, valid) megatron GPTDatasets over the manifest's shards (`ResponseDataset`s for instruction data)."""
    tok = manifest.tokenizer
    tokenizer = DatasetTokenizer(tok.vocab_size, tok.eos_id, tok.pad_id, tok.sha256)
    tokens = _build(cfg, manifest, train_samples, valid_samples, GPTDataset, lambda p: p, tokenizer)
    if not manifest.loss_masks:  # pretraining data: every token scored
        return tokens
    masks = _build(
        cfg, manifest, train_samples, valid_samples, MaskDocumentsGPTDataset, loss_mask_prefix, MASK_TOKENIZER
    )
    for split, (a, b) in zip(("train", "valid"), zip(tokens, masks)):
        _check_same_windows(a, b, f"{manifest.dir} ({split})")
    return tuple(ResponseDataset(a, b) for a, b in zip(tokens, masks))


def _build(cfg, manifest, train_samples, valid_samples, dataset_class, prefix, tokenizer):
    """(train, valid) `dataset_class` datasets over the shards `prefix(p)` of the manifest's prefixes p."""

    def blend(name: str) -> tuple[list[str], list[float] | None]:  # the split's shards and their blend weights
        split = manifest.split(name)
        return [prefix(p) for p in split.prefixes], list(split.weights) or None

    ds_cfg = GPTDatasetConfig(
        random_seed=cfg.train.seed,
        sequence_length=cfg.train.seq_length,
        blend_per_split=[blend("train"), blend("valid"), None],
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=str(Path(manifest.dir) / "index_cache"),
        mid_level_dataset_surplus=0.005,
    )
    train, valid, _ = BlendedMegatronDatasetBuilder(
        dataset_class, [train_samples, valid_samples, 0], lambda: True, ds_cfg
    ).build()
    return train, valid


def _low_level(dataset) -> list:
    """The GPTDatasets of a (blended) megatron dataset, in blend order."""
    if not hasattr(dataset, "datasets"):
        return [dataset]
    return [x for d in dataset.datasets for x in _low_level(d)]


def _check_same_windows(tokens, masks, where: str) -> None:
    """The mask windows are the token windows: the same number of samples and, per shard, the same documents of
    the same lengths (megatron draws the windows from these and the seed alone)."""
    a, b = _low_level(tokens), _low_level(masks)
    same = len(tokens) == len(masks) and len(a) == len(b)
    for x, y in zip(a, b) if same else ():
        same = same and numpy.array_equal(x.dataset.sequence_lengths, y.dataset.sequence_lengths)
        same = same and numpy.array_equal(x.dataset.document_indices, y.dataset.document_indices)
        same = same and numpy.array_equal(x.indices, y.indices)
    if not same:
        raise UserError(
            f"the loss-mask shards of the instruction data at {where} do not match its token shards (other "
            "documents or lengths): prepare the data again (difflm prep) rather than mixing shards of two preps"
        )


def micro_batch(
    dataset, iteration: int, micro: int, dp_rank: int, cfg: PipelineConfig, dp_size: int, length: int | None = None
) -> dict:
    """The micro-batch `micro` of `iteration` for data-parallel rank `dp_rank`: tokens/labels [b, s] (and
    `response` / `response_labels` [b, s] of instruction data).

    `positions` [b] are the sequences' places in the global batch (they key the noise); `length`
    truncates the sequences (variable-length training)."""
    t = cfg.train
    first = micro * t.micro_batch_size * dp_size + dp_rank * t.micro_batch_size
    start = iteration * t.global_batch_size + first
    samples = [dataset[(start + j) % len(dataset)] for j in range(t.micro_batch_size)]
    length = length or t.seq_length
    batch = {
        "tokens": torch.stack([s["tokens"][:length] for s in samples]),  # [b, s] the clean sequence x0
        "labels": torch.stack([s["labels"][:length] for s in samples]),  # [b, s] next tokens (ar mode)
        # [b, s] 0 where megatron padded a sample: never scored (its token id there is not data)
        "loss_mask": torch.stack([s["loss_mask"][:length] for s in samples]).bool(),
        "positions": torch.arange(first, first + t.micro_batch_size),
    }
    if "response" in samples[0]:  # instruction data: [b, s] bool, the response tokens among tokens / labels
        keys = ("response", "response_labels", "documents")  # [b, s]: bool, bool, each token's conversation
        batch.update({k: torch.stack([s[k][:length] for s in samples]) for k in keys})
    return batch
