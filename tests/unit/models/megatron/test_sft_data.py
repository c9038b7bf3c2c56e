"""Training reads instruction data's loss mask: sample k of the mask windows is the mask of sample k's tokens,
mask shards of other documents are refused, and the forward step's loss counts the response tokens only."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import tiny_config
from instruction_data import conversations, is_response, write_instruction_data

from difflm.errors import UserError
from difflm.manifest import loss_mask_prefix
from difflm.models.diffusion.modes import build_objective
from difflm.models.megatron.data import ResponseDataset, build_datasets, micro_batch
from difflm.models.megatron.forward_step import SpecialTokens
from difflm.models.megatron.train import build_training, run_global_batch


def test_each_window_carries_the_mask_of_its_own_tokens(tmp_path, tiny_manifest):
    manifest = write_instruction_data(tmp_path / "sft", tiny_manifest)
    cfg = tiny_config(tmp_path)
    eos = manifest.tokenizer.eos_id
    train, valid = build_datasets(cfg, manifest, 64, 16)
    assert isinstance(train, ResponseDataset) and isinstance(valid, ResponseDataset)
    responses = 0
    for ds, n in ((train, 64), (valid, 16)):
        for k in range(n):
            s = ds[k]
            data = s["loss_mask"].bool()  # megatron's padding (a short last window) is never a response
            assert torch.equal(s["response"] & data, is_response(s["tokens"], eos) & data), k
            assert torch.equal(s["response_labels"] & data, is_response(s["labels"], eos) & data), k
            # one conversation, one document: the EOS closing an inner turn does not end it
            assert torch.equal(s["documents"][data], conversations(s["tokens"][None])[0][data]), k
            responses += int(s["response"].sum())
    assert 0 < responses < (64 + 16) * cfg.train.seq_length  # prompts and responses both occur
    multi_turn = [k for k in range(64) if (train[k]["tokens"][:-1].eq(eos) & ~train[k]["tokens"][1:].eq(5)).any()]
    assert multi_turn, "some window holds an EOS inside a conversation"
    # pretraining data (the same manifest read as text) has no response mask: every token is scored
    assert "response" not in build_datasets(cfg, manifest.replace(kind="pretraining"), 8, 8)[0][0]


def test_mask_shards_of_other_documents_are_refused(tmp_path, tiny_manifest):
    manifest = write_instruction_data(tmp_path / "sft", tiny_manifest)
    other = write_instruction_data(tmp_path / "other", tiny_manifest, seed=1)
    prefix, foreign = manifest.split("train").prefixes[0], other.split("train").prefixes[0]
    for ext in (".bin", ".idx"):
        shutil.copy(loss_mask_prefix(foreign) + ext, loss_mask_prefix(prefix) + ext)
    with pytest.raises(UserError, match="loss-mask shards .* do not match its token shards"):
        build_datasets(tiny_config(tmp_path), manifest, 16, 16)


@pytest.mark.parametrize("mode", ["difflm-noshift", "ar"])
def test_the_forward_steps_loss_counts_response_tokens_only(megatron_single_process, tmp_path, tiny_manifest, mode):
    """Through the real forward step and megatron's schedule: the loss's count is the batch's response tokens
    (the normaliser of SFT's loss), not its window length."""
    manifest = write_instruction_data(tmp_path / "sft", tiny_manifest)
    cfg = tiny_config(tmp_path, f"diffusion.model_running_mode={mode}", "model.document_attention=true")
    t = cfg.train
    special = SpecialTokens.from_manifest(manifest.tokenizer)
    objective = build_objective(cfg.diffusion, special.ids())
    ddp, _, _ = build_training(cfg, manifest.tokenizer.vocab_size, objective=objective)
    train, _ = build_datasets(cfg, manifest, 4 * t.global_batch_size, t.global_batch_size)
    total = run_global_batch(
        cfg, ddp, train, special, step=2, noise_step=2, forward_only=True, reduce=False, objective=objective
    )
    batch = micro_batch(train, 2, 0, 0, cfg, 1)
    scored = batch["response"] if objective.bidirectional else batch["response_labels"]  # AR: the next token
    assert int(total[1]) == int(scored.sum()) < batch["tokens"].numel()
    assert torch.isfinite(total[0]) and float(total[0]) > 0
