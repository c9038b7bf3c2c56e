"""Generation and conditional likelihood on the exported model class (random weights, no megatron)."""

from __future__ import annotations

import math
import types

import pytest
import torch
from helpers import HF_VOCAB as V
from helpers import timed_hf_model as _model

from difflm.models.diffusion import MaskedSampler


def _left_pad(rows: list[list[int]], pad: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


PROMPTS = [[5, 9, 11, 40, 7], [12, 13], [30, 31, 32]]


@pytest.mark.parametrize(
    "settings",
    [MaskedSampler(steps=8), MaskedSampler(steps=8, block_length=4), MaskedSampler(threshold=0.05, block_length=4)],
)
def test_batched_left_padded_generation_equals_one_by_one(settings):
    model = _model()
    ids, mask = _left_pad(PROMPTS)
    batched = model.diffusion_generate(ids, 8, 8, attention_mask=mask, settings=settings)
    for row, prompt in enumerate(PROMPTS):
        alone = model.diffusion_generate(torch.tensor([prompt]), 8, 8, settings=settings)
        assert batched[row, -8:].tolist() == alone[0, -8:].tolist()
        assert batched[row, ids.shape[1] - len(prompt) : ids.shape[1]].tolist() == prompt


def test_ar_generation_with_cache_equals_full_recompute():
    model = _model("ar", document_attention=False)
    model.config.eos_token_id = None  # decode all tokens: random weights might emit EOS
    ids, mask = _left_pad(PROMPTS)
    fast = model.ar_generate(ids, 6, attention_mask=mask)
    for row, prompt in enumerate(PROMPTS):
        x = torch.tensor([prompt])
        for _ in range(6):  # no cache: the whole prefix every step
            x = torch.cat([x, model(x).logits[:, -1, : model.config.real_vocab_size].argmax(-1, keepdim=True)], 1)
        assert fast[row, -6:].tolist() == x[0, -6:].tolist()
    sampled = model.ar_generate(
        ids, 6, temperature=0.8, top_p=0.9, attention_mask=mask, generator=torch.Generator().manual_seed(0)
    )
    assert sampled.shape == (3, ids.shape[1] + 6)


def _cond_batch(model_mode: str):
    ids = torch.tensor([[0, 5, 9, 11, 40, 7], [0, 12, 13, 14, 15, 16]])
    target = torch.zeros_like(ids, dtype=torch.bool)
    target[:, 3:] = True
    return ids, target


@pytest.mark.parametrize("mode", ["difflm-noshift", "difflm-shift", "ar"])
def test_conditional_nll_per_mode(mode):
    model = _model(mode)
    ids, target = _cond_batch(mode)
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(2)]  # noqa: E731
    nll = model.conditional_nll(ids, target, mc_samples=16, generators=gens())
    assert nll.shape == (2,) and (nll > 0).all()
    assert torch.allclose(nll, model.conditional_nll(ids, target, mc_samples=16, generators=gens()))
    # right padding changes nothing: padded positions are neither attended nor scored
    padded = torch.cat([ids, torch.full((2, 3), 2)], 1)
    pmask = torch.cat([torch.ones_like(ids), torch.zeros(2, 3, dtype=torch.long)], 1)
    ptarget = torch.cat([target, torch.ones(2, 3, dtype=torch.bool)], 1)
    again = model.conditional_nll(padded, ptarget, attention_mask=pmask, mc_samples=16, generators=gens())
    assert torch.allclose(nll, again, rtol=1e-4)
    if mode == "ar":  # exact: equals the unconditional ar_nll difference of the two prefixes
        full = model.ar_nll(ids) * (ids.shape[1] - 1)
        ctx = model.ar_nll(ids[:, :3]) * 2
        assert torch.allclose(nll.float(), full - ctx, rtol=1e-4)


def test_uniform_conditional_nll_bounds_the_exact_value_and_greedy_match():
    """A model predicting uniform over the N states has -log p(continuation) = L log N exactly; the uniform bound,
    integral plus the exact last step from the trained eps, estimates it (at eps = 0.2 the last step alone is
    0.54 nats/token: leaving it out would be seen)."""
    model = _model("difflm-noshift-uniform", time_embedding=True, eps=0.2)
    model.forward = lambda tokens, **_: types.SimpleNamespace(logits=torch.zeros(*tokens.shape, V))
    ids = torch.randint(3, V, (16, 28), generator=torch.Generator().manual_seed(0))
    target = torch.zeros_like(ids, dtype=torch.bool)
    target[:, 4:] = True
    nll = model.conditional_nll(
        ids, target, mc_samples=64, generators=[torch.Generator().manual_seed(i) for i in range(16)]
    )
    assert float(nll.mean()) / 24 == pytest.approx(math.log(len(model.uniform_states())), abs=0.25)
    ids, target = _cond_batch("u")
    masked = _model()
    hit = masked.greedy_match(ids, target)
    decoded = masked.diffusion_generate(ids[:, :3], 3, 3)  # greedy, one token per step
    assert hit.tolist() == [bool((decoded[i, 3:] == ids[i, 3:]).all()) for i in range(2)]
    forced = decoded.clone()  # its own greedy decoding is, by definition, a greedy match
    assert masked.greedy_match(forced, target).all()
