"""The strong AR arm of the data-constrained study: masked-input regularisation (MIR, Xu et al. 2026) as an option
of the `ar` objective: an auxiliary next-token loss on a copy of the inputs with a random share masked, the clean
targets unchanged; training runs both rows, validation and the likelihood the clean one."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config

from difflm.config import ConfigError, load_config
from difflm.models.diffusion.modes import Autoregressive, build_objective, objective_from_dict
from difflm.models.megatron.data import build_datasets
from difflm.models.megatron.flops import training_flops
from difflm.models.megatron.forward_step import SpecialTokens, make_forward_step
from difflm.models.megatron.train import build_training, run_global_batch

TOKENS = {"mask_id": 1, "vocab_size": 7, "pad_id": 2, "eos_id": 0}
MIR = ("diffusion.model_running_mode=ar", "diffusion.mir_mask_share=0.5", "diffusion.mir_weight=0.4")


def _gen(seed: int):
    return lambda pos: torch.Generator().manual_seed(seed * 1000 + pos)


def _prepare(obj, tokens, label_ok, seed=0, evaluation=False):
    labels = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)
    positions = list(range(len(tokens)))
    return obj.prepare(tokens, labels, label_ok, positions, _gen(seed), len(tokens), False, evaluation), labels


def _ce(logits, targets):
    """-log softmax(logits)[target] at every position, written out."""
    return -(logits - logits.exp().sum(-1, keepdim=True).log()).gather(-1, targets[..., None]).squeeze(-1)


def test_the_mir_loss_is_the_hand_computed_sum_of_both_cross_entropies():
    tokens = torch.tensor([[3, 4, 5, 6, 3, 4], [6, 5, 4, 3, 0, 2]])
    label_ok = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)  # row 1: padding after EOS
    obj = Autoregressive(**TOKENS, mir_mask_share=0.5, mir_weight=0.4)
    prep, labels = _prepare(obj, tokens, label_ok)

    data = torch.cat([torch.ones_like(label_ok[:, :1]), label_ok[:, :-1]], dim=1)  # tokens 0.. that are data
    masked = torch.stack([torch.rand(6, generator=_gen(0)(p)) < 0.5 for p in (0, 1)]) & data
    assert masked.any() and (~masked & data).any()  # this seed masks some data tokens, not all
    assert torch.equal(prep["inputs"], torch.cat([tokens, torch.where(masked, 1, tokens)]))
    assert torch.equal(prep["targets"], torch.cat([labels, labels]))  # the clean next tokens for both rows
    assert obj.rows_per_sequence(False) == 2 and obj.rows_per_sequence(True) == 1

    logits = torch.randn(4, 6, 7, generator=torch.Generator().manual_seed(1))
    ce = _ce(logits, prep["targets"])  # what megatron's per-token cross-entropy gives the objective
    valid = label_ok.float()
    expected = ((ce[:2] * valid).sum() + 0.4 * (ce[2:] * valid).sum()) / valid.sum()
    total, count = obj.loss_terms(ce, prep, False)
    assert int(count) == 8 and float(total / count) == pytest.approx(float(expected), rel=1e-6)


def test_mir_off_is_todays_ar_loss_and_validation_sees_clean_inputs_only():
    tokens = torch.randint(3, 7, (3, 8), generator=torch.Generator().manual_seed(0))
    label_ok = torch.ones(3, 8, dtype=torch.bool)
    label_ok[2, 5:] = False
    ce = torch.rand(3, 8, generator=torch.Generator().manual_seed(2))
    hand = (ce * label_ok).sum() / label_ok.sum()
    off, _ = _prepare(Autoregressive(**TOKENS), tokens, label_ok)
    assert torch.equal(off["inputs"], tokens) and Autoregressive(**TOKENS).rows_per_sequence(False) == 1
    total, count = Autoregressive(**TOKENS).loss_terms(ce, off, False)
    assert float(total / count) == pytest.approx(float(hand)) and int(count) == 21

    on = Autoregressive(**TOKENS, mir_mask_share=0.5)
    prep, _ = _prepare(on, tokens, label_ok, evaluation=True)  # validation with MIR on: as without it
    assert torch.equal(prep["inputs"], tokens)
    assert [float(x) for x in on.loss_terms(ce, prep, True)] == [float(total), 21.0]


def test_the_masked_share_is_respected_and_the_draw_is_the_generators():
    tokens = torch.randint(3, 7, (4, 250), generator=torch.Generator().manual_seed(0))
    label_ok = torch.ones(4, 250, dtype=torch.bool)
    obj = Autoregressive(**TOKENS, mir_mask_share=0.5)
    prep, _ = _prepare(obj, tokens, label_ok, seed=3)
    share = float((prep["inputs"][4:] == 1).float().mean())
    assert share == pytest.approx(0.5, abs=0.05)  # 1000 Bernoulli(0.5) draws: sd 0.016
    assert float(
        _prepare(Autoregressive(**TOKENS, mir_mask_share=0.1), tokens, label_ok, 3)[0]["mir_masked"].float().mean()
    ) == pytest.approx(0.1, abs=0.03)
    again, _ = _prepare(obj, tokens, label_ok, seed=3)
    assert torch.equal(again["inputs"], prep["inputs"])  # same generators (resume, TP/DP peers): same masks
    other, _ = _prepare(obj, tokens, label_ok, seed=4)
    assert not torch.equal(other["inputs"], prep["inputs"])
    padded = label_ok.clone()
    padded[:, 100:] = False  # tokens 101.. are padding: never masked
    assert not _prepare(obj, tokens, padded, seed=3)[0]["mir_masked"][:, 101:].any()


def test_a_uniform_draw_gives_each_sequence_its_own_share_in_twice_the_mean():
    """Xu et al. draw each sequence's share from [0, 0.5]: over 200 sequences of 500 tokens the shares spread over
    that range (a fixed share's spread is the binomial's, sd 0.02) and average 0.25; the same generators draw
    the same shares."""
    tokens = torch.randint(3, 7, (200, 500), generator=torch.Generator().manual_seed(0))
    label_ok = torch.ones(200, 500, dtype=torch.bool)
    shares = {}
    for draw in ("fixed", "uniform"):
        obj = Autoregressive(**TOKENS, mir_mask_share=0.25, mir_share_draw=draw)
        shares[draw] = _prepare(obj, tokens, label_ok, seed=5)[0]["mir_masked"].float().mean(1)
    fixed, uniform = shares["fixed"], shares["uniform"]
    assert float(fixed.std()) < 0.03 and float(uniform.std()) > 0.1  # U[0, 0.5]: sd 0.144
    assert float(uniform.mean()) == pytest.approx(0.25, abs=0.03) and float(uniform.max()) < 0.56
    assert float(uniform.min()) < 0.05 and float(uniform.max()) > 0.45
    again = _prepare(Autoregressive(**TOKENS, mir_mask_share=0.25, mir_share_draw="uniform"), tokens, label_ok, 5)
    assert torch.equal(again[0]["mir_masked"].float().mean(1), uniform)


def test_settings_round_trip_count_flops_and_refuse_bad_input_with_one_line(tmp_path):
    cfg = tiny_config(tmp_path, *MIR)
    obj = build_objective(cfg.diffusion, TOKENS)
    assert obj.to_dict() == {
        "mode": "ar",
        "mir_mask_share": 0.5,
        "mir_weight": 0.4,
        "mir_share_draw": "fixed",
        "sft_eos": "turn",
    }
    assert objective_from_dict(obj.to_dict(), TOKENS) == obj
    plain = tiny_config(tmp_path, "diffusion.model_running_mode=ar")
    assert plain.stage_hash("diffusion") != cfg.stage_hash("diffusion")  # MIR names its runs
    flops = training_flops(cfg, 512, [32], 4, objective=obj)
    assert flops == 2 * training_flops(plain, 512, [32], 4, objective=build_objective(plain.diffusion))
    cases = {
        "diffusion.mir_mask_share: Input should be less than 1": ("ar", "diffusion.mir_mask_share=1.0"),
        "mir_mask_share is a setting of ar; model_running_mode is difflm-noshift": (
            "difflm-noshift",
            "diffusion.mir_mask_share=0.25",
        ),
        "set diffusion.mir_mask_share > 0": ("ar", "diffusion.mir_weight=0.4"),
        "mir_share_draw: Input should be 'fixed' or 'uniform'": ("ar", "diffusion.mir_share_draw=beta"),
        r"mir_mask_share=0.6 would pass 1; set it to 0.5 or less": (
            "ar",
            "diffusion.mir_mask_share=0.6 diffusion.mir_share_draw=uniform",
        ),
    }
    for line, (mode, bad) in cases.items():
        with pytest.raises(ConfigError, match=line):
            load_config("test-tiny", [f"workdir={tmp_path}", f"diffusion.model_running_mode={mode}", *bad.split()])
    with pytest.raises(ValueError, match=r"set it in \[0, 1\)"):
        Autoregressive(mir_mask_share=1.5)


def test_megatron_forward_step_runs_both_rows_with_their_documents(megatron_single_process, tmp_path, tiny_manifest):
    """Training gives megatron the doubled micro-batch, each row with the packed-document mask of its clean tokens;
    validation the clean rows alone."""
    cfg = tiny_config(tmp_path, *MIR, "model.backend=local", "model.document_attention=true")
    special = SpecialTokens.from_manifest(tiny_manifest.tokenizer)
    obj = build_objective(cfg.diffusion, special.ids())
    model, _, _ = build_training(cfg, 512, objective=obj)
    x0 = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    x0[0, 7] = special.eos_id  # two documents in row 0
    batch = {"tokens": x0, "labels": torch.cat([x0[:, 1:], x0[:, :1]], 1), "positions": torch.tensor([0, 1])}
    output, loss_fn = make_forward_step(cfg, special, step=3, objective=obj)(iter([batch]), model)
    assert output.shape == (4, 16)
    total, count, _ = loss_fn(output)
    assert torch.isfinite(total) and int(count) == 32
    output, loss_fn = make_forward_step(cfg, special, step=3, evaluation=True, objective=obj)(iter([batch]), model)
    assert output.shape == (2, 16)


def test_ar_with_mir_trains_and_its_loss_falls(megatron_single_process, tmp_path, tiny_manifest):
    """The study's whole ar-mir arm: the strong arm's decay (embeddings spared) and dropout, MIR drawn uniform."""
    cfg = tiny_config(
        tmp_path,
        *MIR,
        "diffusion.mir_share_draw=uniform",
        "train.optimizer.lr=1e-2",
        "train.optimizer.weight_decay=0.5",
        "train.optimizer.decay_embeddings=false",
        "model.dropout=0.1",
    )
    tok = tiny_manifest.tokenizer
    special = SpecialTokens.from_manifest(tok)
    obj = build_objective(cfg.diffusion, special.ids())  # once, as the trainer builds it
    ddp, opt, sched = build_training(cfg, tok.vocab_size, objective=obj)
    train_ds, _ = build_datasets(cfg, tiny_manifest, cfg.train.global_batch_size, cfg.train.global_batch_size)
    losses = []
    for step in range(6):  # the same batch each step: its loss must fall
        ddp.zero_grad_buffer()
        opt.zero_grad()
        losses.append(run_global_batch(cfg, ddp, train_ds, special, step=0, noise_step=step, objective=obj))
        opt.step()
        sched.step(increment=1)
    assert all(0 < x < 100 for x in losses) and losses[-1] < losses[0] - 0.5, losses
    valid = run_global_batch(cfg, ddp, train_ds, special, step=0, noise_step=-1, forward_only=True, objective=obj)
    assert valid is not None and 0 < valid < losses[0]


@pytest.mark.parametrize("decay_embeddings", [True, False])
def test_decay_embeddings_false_spares_the_embedding_and_output_layer(
    megatron_single_process, tmp_path, decay_embeddings
):
    """Xu et al.'s strong AR arm decays neither the embedding nor the output layer (megatron decays both). With zero
    gradients an AdamW step moves a weight by its decay alone: the spared ones stay put, a linear layer's shrinks."""
    cfg = tiny_config(
        tmp_path,
        "diffusion.model_running_mode=ar",
        "model.tie_embeddings=false",
        "train.optimizer.weight_decay=0.5",
        "train.schedule.warmup_iters=0",
        f"train.optimizer.decay_embeddings={str(decay_embeddings).lower()}",
    )
    ddp, opt, sched = build_training(cfg, 512, objective=build_objective(cfg.diffusion))
    model = ddp.module
    weights = {
        "embedding": model.embedding.word_embeddings.weight,
        "output": model.output_layer.weight,
        "linear": model.decoder.layers[0].mlp.linear_fc1.weight,
    }
    before = {k: w.detach().clone() for k, w in weights.items()}
    ddp.zero_grad_buffer()
    opt.zero_grad()
    opt.step()
    moved = {k: not torch.equal(w.detach(), before[k]) for k, w in weights.items()}
    assert moved == {"embedding": decay_embeddings, "output": decay_embeddings, "linear": True}, moved
    shrunk = weights["linear"].detach().norm() < before["linear"].norm()
    assert shrunk
