"""Megatron datasets from a data-prep manifest, and the deterministic batch order of a run.

Samples are megatron GPTDatasets (packed, shuffled windows of seq_length+1 tokens) built by
megatron's BlendedMegatronDatasetBuilder. Sample k of a split is fixed by the seed, so the batch of
(iteration, micro-batch, data-parallel rank) is too: a resumed run sees exactly the data the
uninterrupted run would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from difflm.config import PipelineConfig
from difflm.manifest import DataManifest


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


def build_datasets(cfg: PipelineConfig, manifest: DataManifest, train_samples: int, valid_samples: int):
    """(train, valid) megatron GPTDatasets over the manifest's shards."""
    tok = manifest.tokenizer

    def blend(name: str) -> tuple[list[str], list[float] | None]:  # the split's shards and their blend weights
        split = manifest.split(name)
        return list(split.prefixes), list(split.weights) or None

    ds_cfg = GPTDatasetConfig(
        random_seed=cfg.train.seed,
        sequence_length=cfg.train.seq_length,
        blend_per_split=[blend("train"), blend("valid"), None],
        tokenizer=DatasetTokenizer(tok.vocab_size, tok.eos_id, tok.pad_id, tok.sha256),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=str(Path(manifest.dir) / "index_cache"),
        mid_level_dataset_surplus=0.005,
    )
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [train_samples, valid_samples, 0], lambda: True, ds_cfg
    ).build()
    return train, valid


def micro_batch(
    dataset, iteration: int, micro: int, dp_rank: int, cfg: PipelineConfig, dp_size: int, length: int | None = None
) -> dict:
    """The micro-batch `micro` of `iteration` for data-parallel rank `dp_rank`: tokens/labels [b, s].

    `positions` [b] are the sequences' places in the global batch (they key the noise); `length`
    truncates the sequences (variable-length training)."""
    t = cfg.train
    first = micro * t.micro_batch_size * dp_size + dp_rank * t.micro_batch_size
    start = iteration * t.global_batch_size + first
    samples = [dataset[(start + j) % len(dataset)] for j in range(t.micro_batch_size)]
    length = length or t.seq_length
    return {
        "tokens": torch.stack([s["tokens"][:length] for s in samples]),  # [b, s] the clean sequence x0
        "labels": torch.stack([s["labels"][:length] for s in samples]),  # [b, s] next tokens (ar mode)
        # [b, s] 0 where megatron padded a sample: never scored (its token id there is not data)
        "loss_mask": torch.stack([s["loss_mask"][:length] for s in samples]).bool(),
        "positions": torch.arange(first, first + t.micro_batch_size),
    }
