"""Block diffusion (difflm-block, BD3-LM): the two-stream mask, its FlexAttention form, training terms, the block
ELBO by enumeration, exact KV-cached block decoding, megatron and HF parity."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from helpers import CharTokenizer, block_megatron, save_megatron_checkpoint, tiny_config, tiny_hf_model
from torch.nn.attention.flex_attention import flex_attention

from difflm.config import load_config
from difflm.models import diffusion
from difflm.models.diffusion.blocks import attention_pairs, block_elbo_terms, decode_keep, two_stream_keep
from difflm.models.diffusion.modes import BlockDiffusion, build_objective, objective_class
from difflm.models.diffusion.samplers import MaskedSampler
from difflm.models.evaluation.generation import sampler_settings
from difflm.models.evaluation.scoring import Scorer
from difflm.models.hf.convert import export_hf, load_hf
from difflm.models.megatron.attention import TwoStreamMask, _flex_attention
from difflm.models.megatron.flops import forward_flops_per_sequence
from difflm.models.megatron.forward_step import SpecialTokens, make_forward_step, two_stream_mask
from difflm.models.megatron.gpt import layer_spec

V = 64  # ids 0 eos, 1 mask, 2 pad


def brute_force_keep(length: int, size: int, token_causal: bool) -> torch.Tensor:
    """BD3-LM's rule, one (query, key) pair at a time."""
    keep = torch.zeros(2 * length, 2 * length, dtype=torch.bool)
    for q in range(2 * length):
        for k in range(2 * length):
            q_clean, k_clean = q >= length, k >= length
            qp, kp = q - length * q_clean, k - length * k_clean
            bq, bk = qp // size, kp // size
            if not q_clean and not k_clean:
                keep[q, k] = bq == bk
            elif not q_clean and k_clean:
                keep[q, k] = bk < bq
            elif q_clean and k_clean:
                keep[q, k] = kp <= qp if token_causal else bk <= bq
    return keep


@pytest.mark.parametrize("token_causal", [False, True])
@pytest.mark.parametrize("length", [8, 12])
@pytest.mark.parametrize("size", [1, 2, 4, "L"])
def test_mask_equals_a_brute_force_loop(length, size, token_causal):
    size = length if size == "L" else size
    keep = two_stream_keep(length, size, token_causal)[0, 0]
    assert torch.equal(keep, brute_force_keep(length, size, token_causal))
    assert not keep[length:, :length].any()  # no clean-to-noisy edge
    assert keep.diagonal().all()  # every token sees itself: no empty softmax row
    pairs = attention_pairs(length, size, token_causal)
    assert pairs == int(keep.sum())  # the FLOPs count is what the mask computes
    if size == length:  # one block: the noisy half is fully bidirectional and sees no clean token
        assert keep[:length, :length].all() and not keep[:length, length:].any()


def test_decode_mask_is_the_training_rule_on_the_decoded_layout():
    """[finished blocks (clean) | current block (noisy)]: the last block sees every clean token and itself, the
    clean part is the clean half's rule, blocks counted from position 0 as in training."""
    size, n_clean = 3, 8  # the current block starts mid-way through block 2: its first token is a kept one
    keep = decode_keep(n_clean + size, n_clean + size, n_clean, size, False)[0, 0]
    noisy = slice(n_clean, n_clean + size)
    assert not keep[:n_clean, noisy].any()
    blocks = torch.arange(n_clean + size) // size
    assert torch.equal(keep[noisy, :n_clean], (blocks[:n_clean] < blocks[noisy, None]))  # earlier blocks only
    assert torch.equal(keep[:n_clean, :n_clean], blocks[None, :n_clean] <= blocks[:n_clean, None])
    aligned = decode_keep(12, 12, 9, size, False)[0, 0]  # the training rule, clean half then noisy block
    train = two_stream_keep(12, size)[0, 0]
    assert torch.equal(aligned[:9, :9], train[12:21, 12:21]) and torch.equal(aligned[9:, 9:], train[9:12, 9:12])
    assert torch.equal(aligned[9:, :9], train[9:12, 12:21])


def test_flex_attention_mask_mod_gives_the_dense_mask():
    """The mask_mod the GPU path hands FlexAttention, materialised on the CPU: the same rule, documents too."""
    length, size = 12, 4
    doc = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    for token_causal in (False, True):
        mask = TwoStreamMask(length, size, token_causal, doc)
        mod = mask.mask_mod()
        q = torch.arange(2 * length)[:, None]
        k = torch.arange(2 * length)[None]
        for b in range(2):
            got = mod(torch.tensor(b), torch.tensor(0), q, k)
            assert torch.equal(got, mask.dense_keep()[b, 0])
        plain = TwoStreamMask(length, size, token_causal).dense_keep()[0, 0]
        assert torch.equal(plain, brute_force_keep(length, size, token_causal))
    try:
        bm = TwoStreamMask(length, size, False, device=torch.device("cpu")).block_mask()
        qkv = torch.randn(3, 1, 2, 24, 8)
        got = flex_attention(*qkv, block_mask=bm)
    except Exception as e:  # a torch without FlexAttention on the CPU: the dense equality above still holds
        pytest.skip(f"FlexAttention does not run on this CPU: {e}")
    ref = torch.nn.functional.scaled_dot_product_attention(*qkv, attn_mask=two_stream_keep(length, size, False))
    assert torch.allclose(got, ref, atol=1e-5)


# ---- training terms ------------------------------------------------------------------------------------------


def _objective(**over) -> BlockDiffusion:
    return BlockDiffusion(mask_id=1, vocab_size=V, pad_id=2, eos_id=0, **over)


def _prepare(objective, x0, evaluation=False, step=0):
    label_ok = torch.ones_like(x0, dtype=torch.bool)
    labels = torch.cat([x0[:, 1:], x0[:, :1]], dim=1)
    return objective.prepare(
        x0,
        labels,
        label_ok,
        list(range(len(x0))),
        lambda pos: torch.Generator().manual_seed(1000 * step + pos),
        len(x0),
        True,
        evaluation,
    )


def test_noise_is_drawn_per_block_and_the_inputs_are_two_streams():
    x0 = torch.randint(3, V, (64, 16))
    prep = _prepare(_objective(block_size=4), x0)
    assert prep["inputs"].shape == (64, 32) and torch.equal(prep["inputs"][:, 16:], x0)
    masked = prep["inputs"][:, :16] == 1
    assert torch.equal(masked, prep["scored"])
    per_block = masked.view(64, 4, 4).float().mean(-1)  # rates differ between the blocks of a row
    assert (per_block.std(-1) > 0).float().mean() > 0.5
    w = prep["weight"].view(64, 4, 4)
    assert torch.equal(w, w[..., :1].expand_as(w))  # one weight (1/t) per block
    # evaluation: exactly ceil(t n_j) masks per block (at least one), weight n_j / count
    ev = _prepare(_objective(block_size=4), x0, evaluation=True)
    counts = ev["scored"].view(64, 4, 4).sum(-1)
    assert (counts >= 1).all()
    assert torch.allclose(ev["weight"].view(64, 4, 4)[..., 0], 4 / counts.float())


def test_loss_takes_the_noisy_half_and_the_ar_term_on_the_clean_half():
    x0 = torch.randint(3, V, (2, 8))
    plain = _objective(block_size=4)
    with_ar = _objective(block_size=4, ar_loss_weight=2.0, clean_attention="token_causal")  # as the config needs
    prep = _prepare(plain, x0)
    ce = torch.rand(2, 16)
    total, count = plain.loss_terms(ce, prep, False)
    expected = (ce[:, :8] * prep["scored"] * prep["weight"]).sum()
    assert torch.allclose(total, expected) and count == 16
    total_ar, _ = with_ar.loss_terms(ce, prep, False)
    assert torch.allclose(total_ar, expected + 2.0 * ce[:, 8:].sum())
    assert torch.allclose(with_ar.loss_terms(ce, prep, True)[0], plain.loss_terms(ce, prep, True)[0])  # the bound


def test_config_refuses_what_does_not_apply(tmp_path):
    base = ["diffusion.model_running_mode=difflm-block"]
    with pytest.raises(Exception, match="token_causal"):
        load_config("test-tiny", [f"workdir={tmp_path}", *base, "diffusion.ar_loss_weight=1.0"])
    with pytest.raises(Exception, match="model.backend=torch"):
        load_config("test-tiny", [f"workdir={tmp_path}", *base, "model.backend=te"])
    with pytest.raises(Exception, match="one t per block"):
        load_config("test-tiny", [f"workdir={tmp_path}", *base, "diffusion.time_embedding=true"])
    ok = load_config(
        "test-tiny",
        [f"workdir={tmp_path}", *base, "diffusion.clean_attention=token_causal", "diffusion.ar_loss_weight=3.3"],
    )
    assert ok.diffusion.block_size == 4


def test_flops_count_two_streams_and_the_masked_pairs(tmp_path):
    block = tiny_config(tmp_path, "diffusion.model_running_mode=difflm-block", "diffusion.block_size=4")
    full = tiny_config(tmp_path)
    n = 64
    f_block = forward_flops_per_sequence(block, 512, n, objective=build_objective(block.diffusion))
    f_full = forward_flops_per_sequence(full, 512, n, objective=build_objective(full.diffusion))
    f_full_2n = forward_flops_per_sequence(full, 512, 2 * n, objective=build_objective(full.diffusion))
    assert f_full < f_block < f_full_2n  # twice the tokens, fewer attention pairs than (2n)^2
    assert objective_class("difflm-block")(block_size=4).attention_pairs(n) == attention_pairs(n, 4, False)


# ---- the exported model ---------------------------------------------------------------------------------------


def _model(size: int = 4, clean: str = "block_causal", mode: str = "difflm-block", seed: int = 0, vocab: int = V):
    block = mode == "difflm-block"
    return tiny_hf_model(
        mode, seed, vocab, block_size=size if block else None, clean_attention=clean if block else None
    )


@torch.no_grad()
def test_block_size_one_clean_half_is_a_causal_forward():
    block = _model(size=1)
    ar = _model(mode="ar")
    ar.load_state_dict(block.state_dict())
    x0 = torch.randint(3, V, (2, 12))
    xt = torch.where(torch.rand(2, 12) < 0.5, torch.ones_like(x0), x0)
    two = block(xt, clean_ids=x0).logits
    assert torch.allclose(two[:, 12:], ar(x0).logits, atol=1e-5)
    # token-causal clean half: causal whatever the block size
    tc = _model(size=4, clean="token_causal")
    tc.load_state_dict(block.state_dict())
    assert torch.allclose(tc(xt, clean_ids=x0).logits[:, 12:], ar(x0).logits, atol=1e-5)


@torch.no_grad()
def test_noisy_block_sees_only_itself_and_earlier_clean_blocks():
    model = _model(size=4)
    x0 = torch.randint(3, V, (1, 12))
    xt = x0.clone()
    xt[:, [1, 5, 9]] = 1
    base = model(xt, clean_ids=x0).logits
    later_clean = x0.clone()
    later_clean[0, 6] = (later_clean[0, 6] + 1) % V  # a clean token of block 1
    moved = (model(xt, clean_ids=later_clean).logits - base).abs().amax(-1)[0]
    assert moved[:8].max() < 1e-6  # noisy blocks 0, 1 and clean block 0 do not see it
    assert moved[8:12].min() > 1e-6 and moved[12 + 4 :].min() > 1e-6  # noisy block 2 and clean blocks 1, 2 do


# ---- the block ELBO by enumeration ----------------------------------------------------------------------------

TINY_V = 4  # real tokens 3, 4, 5, 6 on a model whose other ids are never predicted
REAL = torch.arange(3, 3 + TINY_V)


def _tiny():
    model = _model(size=2, vocab=64, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(6.0) if p.dim() > 1 else None  # a sharp, context-dependent model
    return model


def _log_probs(model, xt, x0):
    logits = model(xt[None], clean_ids=x0[None]).logits[0, : len(xt)].double()
    keep = torch.full((logits.shape[-1],), float("-inf"), dtype=torch.float64)
    keep[REAL] = 0
    return torch.log_softmax(logits + keep, -1)


def _restricted(model):
    """logits_fn of the model with every id outside REAL removed (a distribution over the tiny vocabulary)."""

    def fn(xt, clean, rows):
        logits = model(xt, clean_ids=clean).logits[:, : xt.shape[1]].clone()
        out = torch.full_like(logits, -1e9)
        out[..., REAL] = logits[..., REAL]
        return out

    return fn


def exact_block_elbo(model, x0: torch.Tensor, size: int) -> float:
    """Sum over blocks of E_{l ~ U{1..n}} E_{|M| = l} [(n / l) sum_{i in M} -log p(x_i | x_t^j, x_0^{<j})]: every
    subset of every block enumerated (token 0 is given, as evaluation scores tokens 1..)."""
    s = len(x0)
    total = 0.0
    for a in range(0, s, size):
        scored = [i for i in range(a, min(a + size, s)) if i > 0]
        n = len(scored)
        for l in range(1, n + 1):
            subsets = list(itertools.combinations(scored, l))
            for m in subsets:
                xt = x0.clone()
                xt[list(m)] = 1
                lp = _log_probs(model, xt, x0)
                total += (n / l) * -sum(lp[i, x0[i]].item() for i in m) / len(subsets) / n
    return total


def exact_nll(model, x0: torch.Tensor, size: int) -> float:
    """-log p(x_1.. | x_0) of the model's generative process: block by block, inside a block one random position
    at a time (every order enumerated), each drawn given the earlier clean blocks and the revealed tokens."""
    s = len(x0)
    log_p = 0.0
    for a in range(0, s, size):
        pos = [i for i in range(a, min(a + size, s)) if i > 0]
        probs = []
        for order in itertools.permutations(pos):
            xt = x0.clone()
            xt[pos] = 1
            xt[a + size :] = 1  # later blocks: their noisy tokens are not seen by block j anyway
            prob = 1.0
            for i in order:
                prob *= _log_probs(model, xt, x0)[i, x0[i]].exp().item()
                xt[i] = x0[i]
            probs.append(prob)
        log_p += math.log(sum(probs) / len(probs))
    return -log_p


@torch.no_grad()
@pytest.mark.parametrize(
    ("n_draws", "tail_len"),
    [
        pytest.param(60, 2, id="fast"),  # ~1 s of CPU: the unit tier
        pytest.param(300, 3, id="full", marks=pytest.mark.slow),  # ~5 s: a tighter estimate, two whole blocks
    ],
)
def test_block_elbo_is_unbiased_and_bounds_the_exact_nll(n_draws, tail_len):
    model = _tiny()
    x0 = torch.tensor([3, 5, 4, 6, 3])  # blocks {0, 1}, {2, 3}, {4}; token 0 given
    scored = torch.tensor([[False, True, True, True, True]])
    exact = exact_block_elbo(model, x0, 2)
    draws = torch.tensor(
        [
            block_elbo_terms(_restricted(model), x0[None], scored, 1, 2, 2, torch.Generator().manual_seed(s)).item()
            for s in range(n_draws)
        ],
        dtype=torch.float64,
    )
    se = draws.std().item() / math.sqrt(len(draws))
    assert se > 0 and abs(draws.mean().item() - exact) < 4 * se, (draws.mean().item(), exact, se)
    # not below the exact NLL of the model's own block-by-block process, for every sequence of a short length
    total = 0.0
    for rest in itertools.product(range(3, 3 + TINY_V), repeat=tail_len):
        seq = torch.tensor([3, *rest])
        nll = exact_nll(model, seq, 2)
        total += math.exp(-nll)
        assert exact_block_elbo(model, seq, 2) >= nll - 1e-9, (rest,)
    assert total == pytest.approx(1.0, abs=1e-9)  # a distribution: the enumeration is complete


@torch.no_grad()
def test_hf_bound_and_conditional_use_the_block_elbo():
    model = _model(size=4)
    x0 = torch.randint(3, V, (2, 12))
    per_token = model.elbo_nll(x0, t_samples=4, generator=torch.Generator().manual_seed(0), prefix_len=1)
    assert per_token.shape == (2,) and torch.isfinite(per_token).all() and (per_token > 0).all()
    target = torch.zeros_like(x0, dtype=torch.bool)
    target[:, 6:] = True
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    both = model.conditional_nll(x0, target, mc_samples=4, generators=gens)
    alone = model.conditional_nll(x0[1:], target[1:], mc_samples=4, generators=[torch.Generator().manual_seed(2)])
    assert both[1].item() == pytest.approx(alone[0].item(), rel=1e-5)  # a row does not depend on its batch


@torch.no_grad()
def test_greedy_match_is_what_block_decoding_produces():
    """The continuation greedy block decoding (1 token per step, most confident first) writes is a greedy match;
    changing one of its tokens is not (the context is one whole block, so both use the same blocks)."""
    model = _model(size=4)
    prompt = torch.randint(3, V, (3, 4))
    seq = model.block_generate(prompt, 8, MaskedSampler(steps=8, stop_at_eos=False))
    target = torch.zeros_like(seq, dtype=torch.bool)
    target[:, 4:] = True
    assert model.greedy_match(seq, target).all()
    other = seq.clone()
    other[:, 9] = torch.where(other[:, 9] == 3, 4, 3)
    assert not model.greedy_match(other, target).any()


@pytest.mark.parametrize("clean", ["block_causal", "token_causal"])
@torch.no_grad()
def test_greedy_match_holds_for_prompts_that_end_inside_a_block(clean):
    """Decoding uses training's blocks, counted from position 0: the prompt's last, partial block is the first
    one decoded. So greedy_match describes the model's own greedy decoding whatever the prompt's length."""
    for seed in range(3):
        model = _model(size=4, clean=clean, seed=seed)
        for p in (5, 6, 7):
            prompt = torch.randint(3, V, (3, p), generator=torch.Generator().manual_seed(100 * seed + p))
            seq = model.block_generate(prompt, 8, MaskedSampler(steps=8, stop_at_eos=False))
            target = torch.zeros_like(seq, dtype=torch.bool)
            target[:, p:] = True
            assert model.greedy_match(seq, target).all(), (seed, p)


# ---- decoding -------------------------------------------------------------------------------------------------


def test_the_kv_cache_is_a_sampler_setting_the_command_line_turns_off():
    """`eval.sampler.kv_cache=false` was unknown (only Python had an undocumented use_cache)."""
    assert sampler_settings(load_config("test-tiny").eval).kv_cache is True
    assert sampler_settings(load_config("test-tiny", ["eval.sampler.kv_cache=false"]).eval).kv_cache is False


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("clean", ["block_causal", "token_causal"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@torch.no_grad()
def test_kv_cached_decoding_gives_the_uncached_tokens(clean, temperature, documents):
    model = _model(size=4, clean=clean)
    model.config.document_attention = documents
    prompt = torch.randint(3, V, (2, 6))
    prompt[:, 2] = 0  # an EOS: with document attention the continuation sees only the last document
    settings = MaskedSampler(steps=8, temperature=temperature, stop_at_eos=False)
    out = {}
    for cache in (True, False):
        stats: dict = {}
        with_cache = dataclasses.replace(settings, kv_cache=cache)  # the sampler setting eval.sampler.kv_cache
        out[cache] = model.block_generate(prompt, 10, with_cache, torch.Generator().manual_seed(5), stats=stats)
        assert stats["settings"]["kv_cache"] == cache and stats["settings"]["block_size"] == 4
    assert out[True].shape == (2, 16) and torch.equal(out[True][:, :6], prompt)
    assert torch.equal(out[True], out[False])
    assert not (out[True] == 1).any()  # nothing left masked
    if documents:  # the first document of the prompt is not seen: changing it changes nothing
        other = prompt.clone()
        other[:, :2] = 5
        again = model.block_generate(other, 10, settings, torch.Generator().manual_seed(5))
        assert torch.equal(again[:, 6:], out[True][:, 6:])


@torch.no_grad()
def test_kv_cache_equals_the_clean_half_of_a_full_forward():
    """Keys and values cached block by block equal those of one forward over the finished sequence, whose
    logits are the clean half of training's [x_t | x_0] forward (the prompt is two whole blocks: aligned)."""
    model = _model(size=4)
    seq = model.block_generate(torch.randint(3, V, (1, 8)), 8, MaskedSampler(steps=8, stop_at_eos=False))
    whole = [{} for _ in model.layers]
    logits = model(seq, past_key_values=whole, attention_keep=decode_keep(16, 16, 16, 4, False)).logits
    assert torch.allclose(logits, model(torch.ones_like(seq), clean_ids=seq).logits[:, 16:], atol=1e-5)
    parts = [{} for _ in model.layers]
    for a, z in [(0, 8), (8, 12), (12, 16)]:
        model(seq[:, a:z], past_key_values=parts, attention_keep=decode_keep(z, z - a, z, 4, False))
    for w, p in zip(whole, parts):
        assert torch.allclose(w["k"], p["k"], atol=1e-5) and torch.allclose(w["v"], p["v"], atol=1e-5)


@pytest.mark.parametrize("threshold", [0.5, None])
@torch.no_grad()
def test_batched_left_padded_decoding_equals_one_by_one(threshold):
    """Each row keeps its own blocks (from its first token) in a left-padded batch."""
    model = _model(size=4)
    prompts = [torch.randint(3, V, (n,)) for n in (5, 3, 7, 8)]
    width = max(len(p) for p in prompts)
    batch = torch.stack([torch.cat([torch.full((width - len(p),), 2), p]) for p in prompts])
    attn = torch.stack([torch.cat([torch.zeros(width - len(p)), torch.ones(len(p))]) for p in prompts]).long()
    settings = MaskedSampler(steps=6, threshold=threshold, stop_at_eos=False)
    together = model.block_generate(batch, 9, settings, attention_mask=attn)
    for i, p in enumerate(prompts):
        alone = model.block_generate(p[None], 9, settings)
        assert torch.equal(together[i, width:], alone[0, len(p) :]), i


@torch.no_grad()
def test_decoding_stops_at_eos_and_routes_through_generate_continuation():
    model = _model(size=4)
    with torch.no_grad():  # make EOS the most likely token everywhere
        model.embed_tokens.weight[0].mul_(0).add_(model.embed_tokens.weight.sum(0))
    stats: dict = {}
    out = model.generate_continuation(
        torch.randint(3, V, (2, 4)), 12, MaskedSampler(steps=12, stop_at_eos=True), stats=stats
    )
    assert out.shape == (2, 16)
    first = (out[:, 4:] == 0).float().argmax(-1)
    for r in range(2):
        assert (out[r, 4 + first[r] :] == 0).all()
    assert stats["settings"]["block_size"] == 4 and stats["nfe"] >= 1


def test_settings_validate_via_the_objective():
    obj = dataclasses.replace(_objective(), clean_attention="token_causal")
    assert obj.token_causal and obj.model_tokens(10) == 20


# ---- megatron -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend, clean, documents, head_dim",
    [
        ("local", "block_causal", False, None),
        ("torch", "block_causal", False, None),
        ("local", "token_causal", False, None),
        ("torch", "token_causal", False, None),
        ("local", "block_causal", True, None),
        ("torch", "token_causal", True, None),
        ("torch", "block_causal", False, 8),  # a head width apart from hidden/heads, as Qwen3's
    ],
)
def test_megatron_two_stream_forward_matches_the_export(
    megatron_single_process, tmp_path, tiny_manifest, backend, clean, documents, head_dim
):
    over = [f"diffusion.clean_attention={clean}", f"model.document_attention={str(documents).lower()}"]
    cfg, model = block_megatron(tmp_path, backend, *over, *([f"model.kv_channels={head_dim}"] if head_dim else []))
    special = SpecialTokens.from_manifest(tiny_manifest.tokenizer)
    x0 = torch.randint(3, 500, (2, 12))
    x0[:, 5] = special.eos_id  # two packed documents per row
    xt = torch.where(torch.rand(2, 12) < 0.5, torch.full_like(x0, special.mask_id), x0)
    inputs = torch.cat([xt, x0], dim=1)
    pos = (torch.arange(24) % 12)[None].expand(2, -1)
    mask = two_stream_mask(x0, cfg, special, build_objective(cfg.diffusion, special.ids()))
    with torch.no_grad():
        ref = model(inputs, pos, mask, two_stream=True)
    ckpt = tmp_path / f"ckpt-{backend}-{clean}-{documents}-{head_dim}"
    save_megatron_checkpoint(model, ckpt)
    hf = load_hf(export_hf(cfg, tiny_manifest.tokenizer.to_dict(), ckpt, tmp_path / f"hf-{ckpt.name}").folder)
    assert hf.config.objective["block_size"] == 4 and hf.config.objective["clean_attention"] == clean
    docs = diffusion.document_ids(x0, special.eos_id) if documents else None
    got = hf(xt, clean_ids=x0, document_ids=docs).logits
    if documents:  # the documents matter: without them the logits differ
        assert not torch.allclose(hf(xt, clean_ids=x0).logits, ref, atol=1e-4)
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


def test_megatron_forward_step_loss_is_the_objective(megatron_single_process, tmp_path, tiny_manifest):
    cfg, model = block_megatron(
        tmp_path, "local", "diffusion.clean_attention=token_causal", "diffusion.ar_loss_weight=1.0"
    )
    special = SpecialTokens.from_manifest(tiny_manifest.tokenizer)
    x0 = torch.randint(3, 500, (2, 16))
    batch = {
        "tokens": x0,
        "labels": torch.cat([x0[:, 1:], x0[:, :1]], 1),
        "loss_mask": torch.ones(2, 16),
        "positions": torch.tensor([0, 1]),
    }
    step = make_forward_step(cfg, special, step=3, objective=build_objective(cfg.diffusion, special.ids()))
    output, loss_fn = step(iter([batch]), model)
    assert output.shape == (2, 32)  # per-token CE of both halves
    total, count, report = loss_fn(output)
    assert torch.isfinite(total) and int(count) == 32 and total > 0


def test_transformer_engine_is_refused_with_a_clear_line(tmp_path):
    cfg = load_config("test-tiny", [f"workdir={tmp_path}"])
    with pytest.raises(RuntimeError, match="needs model.backend=torch or local"):
        layer_spec(cfg.model, True, "te", two_stream=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_flex_attention_two_stream_mask_matches_dense_with_gradients():
    """The compiled FlexAttention path the torch spec takes on GPUs: the block mask skips tiles (no dense 2L x 2L
    tensor) and gives the dense mask's outputs and gradients."""
    length = 512
    for token_causal in (False, True):
        mask = TwoStreamMask(length, 128, token_causal, device=torch.device("cuda"))
        block = mask.block_mask()
        assert block.sparsity() > 0  # tiles of later clean blocks and other noisy blocks are skipped
        q, k, v = (torch.randn(2, 4, 2 * length, 64, device="cuda", requires_grad=True) for _ in range(3))
        got = _flex_attention()(q, k, v, block_mask=block)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense_keep())
        assert (got - want).abs().max().item() < 1e-4
        grads = torch.autograd.grad(got.sum(), (q, k, v))
        ref = torch.autograd.grad(want.sum(), (q, k, v))
        assert all((a - b).abs().max().item() < 1e-3 for a, b in zip(grads, ref))


@torch.no_grad()
def test_lm_eval_scoring_and_generation_go_through_the_block_objective():
    """The scorer behind `difflm eval` and the lm-eval adapter: log-likelihood (with is_greedy), rolling
    log-likelihood over windows, and generation with the block decoder's settings recorded per sample."""
    scorer = Scorer(_model(size=4), CharTokenizer(), mc_samples=4, max_length=24)
    scores = scorer.loglikelihood([("the cat", " sat"), ("a dog", " ran far")])
    assert all(math.isfinite(ll) and ll < 0 and isinstance(greedy, bool) for ll, greedy in scores)
    rolling = scorer.loglikelihood_rolling(["a text long enough to need more than one window of 24 tokens"])
    assert math.isfinite(rolling[0]) and rolling[0] < 0
    rec = scorer.generate(["the cat", "a"], 8, MaskedSampler(steps=8, stop_at_eos=False))
    assert [r["sampler"]["block_size"] for r in rec] == [4, 4] and rec[0]["sampler"]["kv_cache"]
    assert rec[0]["sampler"]["mode"] == "difflm-block" and rec[0]["model_calls"] >= 8
    empty = _model(size=4).block_generate(torch.zeros(2, 0, dtype=torch.long), 6, MaskedSampler(steps=6))
    assert empty.shape == (2, 6) and not (empty == 1).any()  # no prompt: decoding starts at block 0
