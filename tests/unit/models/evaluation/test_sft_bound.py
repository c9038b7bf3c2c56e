"""The evaluation bound on instruction data is the responses' conditional bound: it reads the loss mask and the
conversations beside the held-out shards, noises only response tokens and counts only them."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config, tiny_hf_model
from instruction_data import conversations, is_response, write_instruction_data

from difflm.models.evaluation.likelihood import instruction_windows, likelihood_bound, validation_windows


@pytest.fixture
def held_out(tmp_path, tiny_manifest):
    manifest = write_instruction_data(tmp_path / "sft", tiny_manifest, documents=(4, 16))
    windows = validation_windows(manifest, 32, 4)
    return manifest, windows, instruction_windows(manifest, windows)


def test_the_held_out_windows_carry_their_response_mask_and_conversations(held_out, tiny_manifest):
    manifest, windows, (scored, documents) = held_out
    assert torch.equal(scored, is_response(windows, manifest.tokenizer.eos_id))
    assert torch.equal(documents, conversations(windows))
    assert instruction_windows(manifest.replace(kind="pretraining"), windows) is None


@pytest.mark.parametrize("mode", ["difflm-noshift", "difflm-shift", "difflm-noshift-uniform"])
def test_the_bound_noises_and_counts_response_tokens_only(held_out, mode):
    _, windows, instruction = held_out
    model = tiny_hf_model(mode, vocab=256)
    seen: list[torch.Tensor] = []
    model.register_forward_pre_hook(lambda _, args: seen.append(args[0].clone()))
    cfg = tiny_config("/tmp/unused")
    result = likelihood_bound(model, windows, cfg, batch_size=4, instruction=instruction)
    scored = instruction[0].clone()
    scored[:, 0] = False
    assert seen and all(not ((x != windows) & ~instruction[0]).any() for x in seen), "noise on a prompt token"
    assert any((x != windows).any() for x in seen)
    assert result.tokens == int(scored.sum()) and result.scored.startswith("the response tokens")
    full = likelihood_bound(model, windows, cfg, batch_size=4)
    assert full.tokens == windows.numel() - len(windows) and full.nll_per_token != result.nll_per_token


def test_ar_scores_the_responses_exactly(held_out):
    _, windows, instruction = held_out
    model = tiny_hf_model("ar", vocab=256)
    result = likelihood_bound(model, windows, tiny_config("/tmp/unused"), batch_size=4, instruction=instruction)
    logits = model(windows, document_ids=instruction[1]).logits[:, :-1].float()
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="none")
    scored = instruction[0][:, 1:]
    expected = ((ce * scored).sum(-1) / scored.sum(-1)).mean()
    assert result.nll_per_token == pytest.approx(float(expected), rel=1e-4)
