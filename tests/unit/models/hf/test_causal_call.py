"""A block-diffusion export called as a causal LM is (`AutoModelForCausalLM`; diffusers' LLaDA2Pipeline calls
`model(input_ids, attention_mask=..., position_ids=...)` on the finished blocks and the block it decodes): it
applies its decoding rule itself and returns logits over what generation may commit. The pipeline end to end:
tests/integration/test_diffusers.py."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_hf_model

from difflm.models.diffusion.blocks import causal_call_keep, decode_keep
from difflm.models.hf.convert import AUTO_MAP

V = 64  # ids 0 eos, 1 mask, 2 pad


def _block_model(**over):
    return tiny_hf_model("difflm-block", 0, V, block_size=4, real_vocab_size=V - 4, **over)


@pytest.mark.parametrize("clean", ["block_causal", "token_causal"])
@pytest.mark.parametrize("shift", [False, True])
@torch.no_grad()
def test_a_plain_call_is_the_decoding_rule_with_the_last_block_noisy(clean, shift):
    model = _block_model(clean_attention=clean, block_shift=shift)
    seq = torch.randint(3, V - 4, (2, 10))
    seq[:, 8:] = 1  # the last (partial) block: being decoded
    ones = torch.ones_like(seq)
    got = model(seq, attention_mask=ones, position_ids=torch.arange(10).expand(2, -1)).logits
    keep = decode_keep(10, 10, 8, 4, clean == "token_causal")
    raw = model(seq, attention_mask=ones, attention_keep=keep).logits  # the rule block decoding applies
    want = model.objective.align_logits(raw)  # logit i predicts token i, with the shift too
    real = got[..., 3 : V - 4]
    assert torch.equal(real, want[..., 3 : V - 4])
    # what generation never commits: the mask, the pad token and the vocabulary's padding rows
    assert torch.isinf(got[..., 1]).all() and torch.isinf(got[..., 2]).all() and torch.isinf(got[..., V - 4 :]).all()
    assert torch.isfinite(got[..., 0]).all()  # EOS stays
    # the rule matters: fully bidirectional attention gives other logits
    bidirectional = model(seq, attention_keep=torch.ones(1, 1, 10, 10, dtype=torch.bool)).logits
    assert not torch.allclose(model.objective.align_logits(bidirectional)[..., 3 : V - 4], real)


def test_the_rule_treats_the_block_of_the_last_key_as_noisy():
    assert torch.equal(causal_call_keep(10, 10, 4, True), decode_keep(10, 10, 8, 4, True))
    assert torch.equal(causal_call_keep(8, 8, 4, True), decode_keep(8, 8, 4, 4, True))
    # block_causal: the block-causal mask whichever block is noisy
    assert torch.equal(causal_call_keep(8, 8, 4, False), decode_keep(8, 8, 8, 4, False))


@torch.no_grad()
def test_position_ids_must_count_up_by_one():
    model = _block_model()
    seq = torch.randint(3, V - 4, (1, 8))
    base = model(seq).logits
    assert torch.equal(model(seq, position_ids=torch.arange(5, 13)[None]).logits, base)  # RoPE is relative
    with pytest.raises(ValueError, match=r"position_ids must count up by one along each row .* or leave them out"):
        model(seq, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]))


@torch.no_grad()
def test_a_full_sequence_model_keeps_its_plain_forward():
    """Only block diffusion changes what a plain call means: a masked model's logits stay the raw ones."""
    model = tiny_hf_model("difflm-noshift", 0, V)
    seq = torch.randint(3, V, (1, 8))
    keep = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    assert torch.allclose(model(seq).logits, model(seq, attention_keep=keep).logits, atol=1e-6)
    assert torch.isfinite(model(seq).logits[..., 1]).all()


def test_exports_answer_to_auto_model_for_causal_lm():
    assert AUTO_MAP["AutoModelForCausalLM"] == "modeling_difflm.DiffLMForMaskedLM"
