"""Fast-dLLM's prefix KV cache for full-sequence masked models (`MaskedSampler.prefix_cache`): exact at the first
step of each block, fewer model positions (FLOPs) per token, recorded in every sample's settings."""

from __future__ import annotations

import pytest
import torch
from helpers import CharTokenizer, tiny_hf_model

from difflm.models.diffusion.samplers import MaskedSampler
from difflm.models.evaluation.scoring import Scorer
from difflm.models.hf.modeling_difflm import PrefixCachedLogits

V = 64  # ids 0 eos, 1 mask, 2 pad


def _model(mode: str = "difflm-noshift", seed: int = 0, **over):
    return tiny_hf_model(mode, seed, V, **over)


MODELS = {
    "masked": lambda: _model(),
    "shifted": lambda: _model("difflm-shift"),
    "time-conditioned": lambda: _model(time_embedding=True),
    "documents": lambda: _model(document_attention=True),
}


def _generate(model, prompt, settings, attention_mask=None):
    stats: dict = {}
    out = model.diffusion_generate(
        prompt,
        12,
        settings.steps,
        generator=torch.Generator().manual_seed(3),
        settings=settings,
        stats=stats,
        attention_mask=attention_mask,
    )
    return out, stats


@pytest.mark.parametrize("kind", sorted(MODELS))
@torch.no_grad()
def test_one_step_per_block_is_exactly_the_uncached_decoding(kind):
    """Each block's first step runs the whole sequence: with one step per block every call is exact."""
    model = MODELS[kind]()
    prompt = torch.randint(3, V, (2, 5))
    prompt[:, 2] = 0  # an EOS: two packed documents for the document-attention model
    for temperature in (0.0, 1.0):
        plain = MaskedSampler(steps=3, block_length=4, temperature=temperature, stop_at_eos=False)
        cached = MaskedSampler(steps=3, block_length=4, temperature=temperature, stop_at_eos=False, prefix_cache=True)
        ref, _ = _generate(model, prompt, plain)
        got, _ = _generate(model, prompt, cached)
        assert torch.equal(got, ref), kind


@torch.no_grad()
def test_first_step_of_each_block_gives_the_uncached_logits_then_fewer_positions():
    model = _model()
    settings = MaskedSampler(steps=12, block_length=4, prefix_cache=True)
    prompt = torch.randint(3, V, (2, 5))
    x = torch.cat([prompt, torch.ones(2, 12, dtype=torch.long)], dim=1)
    fn = PrefixCachedLogits(model, 5, 12, settings, None, None)
    assert torch.equal(fn(x), model(x).logits)  # block 0, step 1: the full forward
    assert fn.positions == 17
    x[:, 5] = 7  # a token of block 0 committed: the next step runs only the block and what follows
    fn(x)
    assert fn.positions == 17 + 12
    x[:, 6:9] = 8  # block 0 finished: block 1's first step is the full forward again, exact
    assert torch.allclose(fn(x), model(x).logits, atol=0) and fn.start == 9


@pytest.mark.parametrize("kind", ["masked", "shifted"])
@torch.no_grad()
def test_prefix_cache_costs_fewer_model_positions_per_token(kind):
    model = MODELS[kind]()
    prompt = torch.randint(3, V, (2, 16))
    settings = MaskedSampler(steps=12, block_length=4, stop_at_eos=False)
    ref, ref_stats = _generate(model, prompt, settings)
    got, stats = _generate(model, prompt, MaskedSampler(**{**settings.__dict__, "prefix_cache": True}))
    assert stats["nfe"] == ref_stats["nfe"] == 12 and not (got == 1).any()
    uncached_positions = ref_stats["nfe"] * ref.shape[1]
    assert stats["model_positions"] < 0.6 * uncached_positions  # 3 of 4 steps skip the prompt and earlier blocks
    assert torch.equal(got[:, :16], prompt)


@torch.no_grad()
def test_left_padded_batch_with_prefix_cache_equals_one_by_one():
    model = _model()
    prompts = [torch.randint(3, V, (n,)) for n in (5, 3)]
    batch = torch.stack([torch.cat([torch.full((5 - len(p),), 2), p]) for p in prompts])
    attn = (batch != 2).long()
    settings = MaskedSampler(steps=12, block_length=4, stop_at_eos=False, prefix_cache=True)
    together, _ = _generate(model, batch, settings, attention_mask=attn)
    for i, p in enumerate(prompts):
        alone, _ = _generate(model, p[None], settings)
        assert torch.equal(together[i, 5:], alone[0, len(p) :]), i


def test_prefix_cache_refuses_what_it_cannot_do():
    model = _model()
    with pytest.raises(ValueError, match="classifier-free guidance"):
        _generate(model, torch.randint(3, V, (1, 4)), MaskedSampler(steps=4, cfg_scale=1.0, prefix_cache=True))
    uniform = _model("difflm-noshift-uniform", time_embedding=True)
    with pytest.raises(ValueError, match="prefix_cache does not apply"):
        _generate(uniform, torch.randint(3, V, (1, 4)), MaskedSampler(steps=4, prefix_cache=True))


@torch.no_grad()
def test_every_sample_records_the_flag():
    scorer = Scorer(_model(), CharTokenizer(), mc_samples=2, max_length=32)
    for flag in (True, False):
        recs = scorer.generate(["the cat", "a", "dog"], 8, MaskedSampler(steps=8, block_length=4, prefix_cache=flag))
        assert [r["sampler"]["prefix_cache"] for r in recs] == [flag] * 3
