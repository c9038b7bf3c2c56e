"""AR-to-diffusion adaptation: Dream's CART weighting, DiffuLLaMA's attention-mask annealing, the presets."""

from __future__ import annotations

import math
from pathlib import Path

import mlflow
import pytest
import torch
from conftest import tiny_config
from helpers import manifest_record
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from difflm.config import CONFIG_DIR, ConfigError, load_config
from difflm.flows.adapt import adapt_difflm, adaptation_config
from difflm.flows.pretrain import pretrain_difflm
from difflm.manifest import DataManifest
from difflm.models.diffusion import anneal_ratio, annealed_attention_mask, cart_weights
from difflm.models.diffusion.modes import MaskedDiffusion, ShiftedMaskedDiffusion, build_objective
from difflm.models.evaluation.likelihood import validation_windows
from difflm.models.evaluation.stages import convert_checkpoint, evaluate_export
from difflm.models.hf.convert import ConversionError
from difflm.models.hf.pretrained import SMOLLM2, fetch_gguf, load_gguf_model, sha256_file, smollm2_folder
from difflm.models.launch.torchrun import launch_training, read_metrics
from difflm.models.megatron.forward_step import SpecialTokens, annealed_mask
from difflm.models.megatron.gpt import build_model
from difflm.rundir import Workdir
from difflm.tasks.adapt import ImportedSource, ar_config, resolve_source, source_lineage, with_import
from difflm.tracking import tracking_uri

# ---- CART (Dream) ------------------------------------------------------------------------------------------


def test_cart_weights_match_a_hand_computed_example():
    # positions 0..5: clean, MASK, clean, MASK, MASK, clean; p = 0.5 makes p(1-p)^(d-1) = 0.5^d
    masked = torch.tensor([[False, True, False, True, True, False]])
    valid = torch.ones_like(masked)
    w = cart_weights(masked, valid, p=0.5)
    # n=1: 0.5*(0.5 [i=0] + 0.5 [i=2] + 0.0625 [i=5]); n=3: 0.5*(0.125 + 0.5 + 0.25); n=4: 0.5*(0.0625 + 0.25 + 0.5)
    expected = torch.tensor([[0.0, 0.53125, 0.0, 0.4375, 0.40625, 0.0]])
    torch.testing.assert_close(w, expected, rtol=0, atol=1e-7)
    # Dream's p = 0.3: one masked token between two clean neighbours has 0.5 * (0.3 + 0.3)
    w = cart_weights(torch.tensor([[False, True, False]]), torch.ones(1, 3, dtype=torch.bool), p=0.3)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.3, 0.0]]))
    # padding is no context: the same row with position 2 invalid keeps only the left neighbour
    w = cart_weights(torch.tensor([[False, True, False]]), torch.tensor([[True, True, False]]), p=0.3)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.15, 0.0]]))


def test_cart_weights_the_shifted_loss_on_the_logit_that_predicts_each_masked_token():
    torch.manual_seed(0)
    b, s = 3, 12
    tokens = torch.randint(0, 15, (b, s))
    label_ok = torch.ones(b, s, dtype=torch.bool)
    label_ok[2, 9:] = False  # padding at the end of row 2
    obj = ShiftedMaskedDiffusion(mask_id=16, vocab_size=16, loss_weighting="cart", cart_p=0.3)
    prep = obj.prepare(
        tokens,
        torch.roll(tokens, -1, 1),
        label_ok,
        [0, 1, 2],
        lambda i: torch.Generator().manual_seed(i),
        b,
        False,
        False,
    )
    masked = prep["inputs"] == 16  # token positions
    valid = torch.cat([torch.ones_like(label_ok[:, :1]), label_ok[:, :-1]], dim=1)
    by_token = cart_weights(masked & valid, valid, 0.3)
    w = prep["token_weights"]
    torch.testing.assert_close(w[:, :-1], by_token[:, 1:])  # logit n-1 predicts token n
    assert (w[~prep["scored"]] == 0).all() and (w[prep["scored"]] > 0).all()
    ce = torch.rand(b, s)
    total, count = obj.loss_terms(ce, prep, evaluation=False)
    torch.testing.assert_close(total, (ce * w * prep["scored"]).sum())
    assert int(count) == int(prep["valid"].sum())
    # validation is the ELBO whatever the weighting: the same numbers as inverse_t's objective
    plain = ShiftedMaskedDiffusion(mask_id=16, vocab_size=16)
    assert obj.loss_terms(ce, prep, evaluation=True) == plain.loss_terms(ce, prep, evaluation=True)


def test_cart_is_an_option_of_the_shift_objective_only(tmp_path):
    with pytest.raises(ValueError, match="needs model_running_mode=difflm-shift"):
        MaskedDiffusion(loss_weighting="cart")
    with pytest.raises(ConfigError, match="loss_weighting=cart .* needs model_running_mode=difflm-shift"):
        tiny_config(tmp_path, "diffusion.loss_weighting=cart")
    with pytest.raises(ConfigError, match="not with mode ar"):
        tiny_config(tmp_path, "diffusion.model_running_mode=ar", "diffusion.attention_anneal_steps=10")
    cfg = tiny_config(tmp_path, "diffusion.model_running_mode=difflm-shift", "diffusion.loss_weighting=cart")
    assert cfg.diffusion.cart_p == 0.3


def test_the_adaptation_options_name_a_run_only_when_set(tmp_path):
    base = tiny_config(tmp_path, "diffusion.model_running_mode=difflm-shift")
    same = tiny_config(tmp_path, "diffusion.model_running_mode=difflm-shift", "diffusion.attention_anneal_steps=0")
    assert "attention_anneal_steps" not in base.identity("diffusion")
    assert base.stage_hash("diffusion") == same.stage_hash("diffusion")
    for over in ("diffusion.attention_anneal_steps=5", "diffusion.loss_weighting=cart", "diffusion.cart_p=0.5"):
        other = tiny_config(
            tmp_path, "diffusion.model_running_mode=difflm-shift", "diffusion.loss_weighting=cart", over
        )
        assert other.stage_hash("diffusion") != base.stage_hash("diffusion")


# ---- attention-mask annealing (DiffuLLaMA) ----------------------------------------------------------------


def test_annealed_mask_is_causal_at_step_0_and_full_from_step_n():
    s, n = 64, 10
    causal_blocked = ~torch.ones(s, s, dtype=torch.bool).tril()
    assert anneal_ratio(0, n) == 0.0 and anneal_ratio(5, n) == 0.5 and anneal_ratio(n, n) == anneal_ratio(99, n) == 1
    assert torch.equal(annealed_attention_mask(0, n, s, torch.Generator().manual_seed(0)), causal_blocked)
    for step in (n, n + 1, 1000):
        assert not annealed_attention_mask(step, n, s, torch.Generator().manual_seed(0)).any()
    prev = None
    for step in range(1, n):
        m = annealed_attention_mask(step, n, s, torch.Generator().manual_seed(step))
        assert not (m & ~causal_blocked).any()  # the past and the token itself are always seen
        seen_future = 1 - m[causal_blocked].float().mean().item()
        assert abs(seen_future - step / n) < 0.06, (step, seen_future)
        assert prev is None or seen_future > prev - 0.06
        prev = seen_future
    again = annealed_attention_mask(3, n, s, torch.Generator().manual_seed(3))
    assert torch.equal(again, annealed_attention_mask(3, n, s, torch.Generator().manual_seed(3)))


def test_the_annealed_model_is_the_ar_model_at_step_0_and_the_bidirectional_one_from_step_n(
    megatron_single_process, tmp_path
):
    def model(*over):
        cfg = tiny_config(tmp_path, *over)
        torch.manual_seed(0)
        return cfg, build_model(cfg, vocab_size=512, objective=build_objective(cfg.diffusion)).eval()

    cfg, annealed = model("diffusion.model_running_mode=difflm-shift", "diffusion.attention_anneal_steps=8")
    _, causal = model("diffusion.model_running_mode=ar")
    _, full = model("diffusion.model_running_mode=difflm-shift")
    causal.load_state_dict(annealed.state_dict())
    full.load_state_dict(annealed.state_dict())
    x = torch.randint(0, 500, (2, cfg.train.seq_length))
    pos = torch.arange(x.shape[1]).expand_as(x)
    with torch.no_grad():

        def at(step, evaluation=False):
            return annealed(x, pos, annealed_mask(cfg, step, evaluation)[None, None])

        torch.testing.assert_close(at(0), causal(x, pos, None), rtol=1e-5, atol=1e-5)
        for step in (8, 9):
            torch.testing.assert_close(at(step), full(x, pos, None), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(at(3, evaluation=True), full(x, pos, None), rtol=1e-5, atol=1e-5)
        middle = at(4)
        assert not torch.allclose(middle, causal(x, pos, None), atol=1e-4)
        assert not torch.allclose(middle, full(x, pos, None), atol=1e-4)


@pytest.mark.slow
def test_annealed_cart_training_runs_and_learns(session_dir, tiny_manifest):
    """A short difflm-shift run with CART and annealing over 10 of its 20 steps: the validation ELBO falls."""
    cfg = tiny_config(
        session_dir / "adapt",
        "diffusion.model_running_mode=difflm-shift",
        "diffusion.loss_weighting=cart",
        "diffusion.attention_anneal_steps=10",
        "model.document_attention=true",
        "train.train_iters=20",
        "train.optimizer.lr=5e-3",
        "train.eval_interval=20",
        "checkpoint.save_interval=20",
    )
    info = launch_training(cfg, tiny_manifest, echo=lambda _: None)
    records = read_metrics(info.run.path)
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(vals) == 2 and vals[-1] < vals[0], vals
    assert all(r["loss"] == r["loss"] for r in records if "loss" in r)  # finite


# ---- presets ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["adapt-dream", "adapt-diffullama"])
def test_adaptation_presets_load_and_cite_their_sources(preset):
    cfg = load_config(preset, [])
    assert cfg.diffusion.model_running_mode == "difflm-shift"
    text = (CONFIG_DIR / f"{preset}.yaml").read_text()
    for line in text.splitlines():  # every setting says where it comes from
        if ":" in line and not line.strip().startswith("#") and not line.rstrip().endswith(":"):
            assert "#" in line, f"{preset}: no source for {line.strip()!r}"
    if preset == "adapt-dream":
        assert cfg.diffusion.loss_weighting == "cart" and cfg.diffusion.attention_anneal_steps == 0
    else:
        assert cfg.diffusion.attention_anneal_steps > 0
        assert cfg.diffusion.normalize_by == "masked_tokens"  # DiffuLLaMA divides by the masked count


def test_diffullama_preset_normalises_its_loss_by_the_masked_tokens():
    cfg = load_config("adapt-diffullama", [])
    special = SpecialTokens(mask_id=1, vocab_size=50, special_ids=(0, 1, 2), eos_id=0, pad_id=2)
    objective = build_objective(cfg.diffusion, special.ids())
    scored = torch.tensor([[True, False, True, False]])
    out = torch.ones(1, 4)
    prepared = {"scored": scored, "t": torch.tensor([0.5]), "valid": torch.ones(1, 4, dtype=torch.bool)}
    total, count = objective.loss_terms(out, prepared, evaluation=False)
    assert float(count) == 2.0 and float(total) == 4.0  # (1/t) * CE summed over the masked, / their count


# ---- a real pretrained LM: SmolLM2-135M-Instruct ---------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_folder()


@pytest.mark.slow
def test_smollm2_folder_gives_the_dequantized_gguf_logits(smollm2):
    gguf = fetch_gguf(SMOLLM2)
    assert sha256_file(gguf) == SMOLLM2.sha256
    reference, ref_tok = load_gguf_model(gguf)
    folder = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    cfg = folder.config
    assert type(folder).__name__ == "LlamaForCausalLM" and cfg.tie_word_embeddings and cfg.vocab_size == 49152
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    text = "The capital of France is"
    ids = tok(text, return_tensors="pt").input_ids
    assert ids.tolist() == ref_tok(text, return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        a, b = folder(ids).logits, reference(ids).logits
    assert torch.equal(a, b)  # the same fp32 weights, the same code
    with torch.no_grad():
        out = folder.generate(ids, max_new_tokens=2, do_sample=False)
    assert tok.decode(out[0, ids.shape[1] :]).startswith(" Paris")


# ---- the flow adapt-difflm ---------------------------------------------------------------------------------

SMALL_RUN = [
    "data.max_documents=40",
    "data.valid_fraction=0.1",
    "train.seq_length=32",
    "train.micro_batch_size=4",
    "train.global_batch_size=4",
    "train.schedule.warmup_iters=1",
    "train.precision=fp32",
    "train.log_interval=5",
    "train.eval_interval=10",
    "train.eval_iters=2",
    "checkpoint.save_interval=10",
    "eval.max_sequences=8",
    "eval.t_samples=2",
    "eval.num_samples=1",
    "eval.sample_length=8",
    "eval.sampler.steps=4",
    "eval.task_items=6",
    "eval.mc_samples=4",
]


@pytest.fixture(scope="module")
def ar_source(tiny_manifest, trained):
    """An `ar` model trained by the pipeline and exported: a source the import of this checkout reads (the shared
    AR run's export)."""
    ar = trained("ar")
    return convert_checkpoint(ar.cfg, tiny_manifest, ar.info).folder


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["adapt-dream", "adapt-diffullama"])
def test_adapt_difflm_flow_evaluates_the_adapted_and_the_source_model_on_the_same_tokens(
    session_dir, prefect_harness, ar_source, preset
):
    workdir = session_dir / f"adapt-flow-{preset}"
    anneal = ["diffusion.attention_anneal_steps=5"] if preset == "adapt-diffullama" else []
    overrides = [f"workdir={workdir}", *SMALL_RUN, "train.train_iters=10", "train.optimizer.lr=3e-3", *anneal]
    summary = adapt_difflm(source=str(ar_source), preset=preset, overrides=overrides)
    assert summary["stages"] == dict.fromkeys(
        ("data-prep", "import", "train", "convert", "evaluate", "export-source-ar", "evaluate-source-ar"), "ran"
    )
    lineage = source_lineage(ar_source)
    assert summary["source"] == lineage and lineage["architecture"] == "DiffLMForMaskedLM"
    assert summary["adapted"]["kind"] == "elbo" and summary["source_ar"]["kind"] == "exact"
    # the source AR row is the source model itself: its export, scored directly, gives the same NLL
    cfg, _ = adaptation_config(str(ar_source), preset, overrides)
    manifest = DataManifest.read(Path(summary["data_dir"]) / "manifest.json")
    direct = evaluate_export(ar_config(cfg), manifest, ar_source, workdir / "direct", untrained=False)
    assert summary["source_ar"]["nll_per_token"] == pytest.approx(direct.trained["nll_per_token"], rel=1e-6)
    # training started from the imported weights: at step 0 the ELBO is already below a uniform model's log V
    records = read_metrics_of(summary["run_dir"])
    first_val = [r["val_loss"] for r in records if "val_loss" in r and r["step"] == 0][0]
    assert first_val < math.log(manifest.tokenizer.vocab_size) - 0.25
    assert "| adapted |" in summary["comparison"] and "| source AR |" in summary["comparison"]

    mlflow.set_tracking_uri(tracking_uri(cfg))
    client = MlflowClient()
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.tags["flow"] == "adapt-difflm"
    assert run.data.tags["source.sha256"] == lineage["sha256"] and run.data.tags["source.path"] == str(ar_source)
    assert run.data.tags["source.architecture"] == "DiffLMForMaskedLM"
    assert run.data.tags["train.init_from"] == summary["checkpoint"]
    assert run.data.params["diffusion.loss_weighting"] == ("cart" if preset == "adapt-dream" else "inverse_t")
    m = run.data.metrics
    assert m["source_ar.trained.nll_per_token"] == pytest.approx(summary["source_ar"]["nll_per_token"])
    assert m["eval.trained.nll_per_token"] == pytest.approx(summary["adapted"]["nll_per_token"])
    assert "adaptation.md" in [a.path for a in client.list_artifacts(run.info.run_id)]
    assert summary["registered_model"].startswith(f"difflm-{preset}-difflm-shift")  # the flagship's registry
    if preset == "adapt-dream":  # a rerun reuses every stage, the evaluations included
        again = adapt_difflm(source=str(ar_source), preset=preset, overrides=overrides)
        assert set(again["stages"].values()) == {"cached"}, again["stages"]
        assert again["comparison"] == summary["comparison"]
        # the flagship takes the same HF folder as train.init_from: the same import, the same run
        flagship = pretrain_difflm(config=cfg)
        assert flagship["run_dir"] == summary["run_dir"] and flagship["stages"]["import"] == "cached"


def read_metrics_of(run_dir):
    return read_metrics(run_dir)


def test_a_gguf_file_or_a_folder_without_weights_is_refused_with_what_to_do(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ConversionError, match="is a GGUF file, not an HF folder: dequantize it"):
        resolve_source(str(gguf))
    with pytest.raises(ConversionError, match="no such folder"):
        resolve_source(str(tmp_path / "nowhere"))
    with pytest.raises(ConversionError, match="no config.json"):
        resolve_source(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConversionError, match="no weights"):
        source_lineage(resolve_source(str(tmp_path)))


@pytest.mark.slow(reason="a real 135M model on 2 cores: import, 8 adaptation steps, both models scored")
def test_smollm2_adapts_its_elbo_falls_and_sits_next_to_its_own_nll(session_dir, prefect_harness, smollm2):
    """The real example end to end on 2 cores: SmolLM2-135M-Instruct imported (parity on real weights: its ar
    export scores the NLL transformers' own LlamaForCausalLM gives on the same windows), a few adaptation steps
    whose validation ELBO falls, and the adapted ELBO next to the source's exact NLL on the same tokens."""
    overrides = [
        f"workdir={session_dir / 'smollm2-adapt'}",
        "data.max_documents=60",
        "data.valid_fraction=0.1",
        "train.seq_length=64",
        "train.micro_batch_size=2",
        "train.global_batch_size=2",
        "train.train_iters=8",
        "train.schedule.warmup_iters=1",
        "train.optimizer.lr=1e-4",
        "train.schedule.min_lr=1e-5",
        "train.precision=fp32",
        "train.eval_interval=8",
        "train.eval_iters=2",
        "train.log_interval=2",
        "checkpoint.save_interval=8",
        "eval.max_sequences=4",
        "eval.t_samples=2",
        "eval.num_samples=1",
        "eval.sample_length=8",
        "eval.sampler.steps=4",
        "eval.task_items=0",  # task scoring costs ~3 min per model here; the tiny flow test scores both models' tasks
        "tracking.registry=false",
        "model.document_attention=false",  # transformers' reference model attends across packed documents
    ]
    summary = adapt_difflm(source="smollm2", preset="adapt-dream", overrides=overrides)
    vals = [r["val_loss"] for r in read_metrics_of(summary["run_dir"]) if "val_loss" in r]
    assert len(vals) == 2 and vals[-1] < vals[0], vals  # the diffusion ELBO falls in a few steps
    source, adapted = summary["source_ar"], summary["adapted"]
    assert source["kind"] == "exact" and adapted["kind"] == "elbo"
    # the source model is the baseline: no randomly initialised model of its size is scored (minutes on a CPU)
    assert "untrained" not in summary["validation"]
    print(
        f"\nSmolLM2 validation ELBO {vals}; source AR NLL {source['nll_per_token']:.4f}, adapted ELBO "
        f"{adapted['nll_per_token']:.4f}"
    )
    print(summary["comparison"])
    # import parity on real weights: the ar export of the imported checkpoint is transformers' model
    manifest = DataManifest.read(Path(summary["data_dir"]) / "manifest.json")
    windows = validation_windows(manifest, 64, 4)
    reference = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reference(windows).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    assert source["nll_per_token"] == pytest.approx(float(nll), rel=1e-4)


# ---- train.init_from (a megatron checkpoint) apart from train.init_from_hf (an HF folder to import) -------------


def test_an_hf_folder_as_init_from_moves_to_init_from_hf_with_a_warning(tmp_path):
    folder, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    ckpt.mkdir()
    (ckpt / "metadata.json").write_text("{}")
    with pytest.warns(DeprecationWarning, match="train.init_from_hf"):
        old = load_config("test-tiny", [f"workdir={tmp_path}", f"train.init_from={folder}"])
    assert old.train.init_from is None and old.train.init_from_hf == str(folder)
    assert load_config("test-tiny", [f"train.init_from={ckpt}"]).train.init_from == str(ckpt)  # a checkpoint stays


def test_a_run_from_an_hf_folder_keeps_its_name(tmp_path):
    """The import stage resolves init_from_hf once into a typed value; the config it trains is named as before
    init_from_hf existed: init_from = the imported checkpoint, nothing else."""
    ckpt = tmp_path / "imports" / "x" / "megatron"
    cfg = load_config("test-tiny", [f"workdir={tmp_path}", "train.init_from_hf=/models/source"])
    trained = with_import(cfg, ImportedSource(ckpt, None, {"sha256": "x"}))
    before = load_config("test-tiny", [f"workdir={tmp_path}", f"train.init_from={ckpt}"])  # how it was named
    manifest = manifest_record("d" * 16)
    assert trained.train.init_from == str(ckpt) and trained.train.init_from_hf is None
    assert Workdir.of(trained).run_for(trained, manifest) == Workdir.of(before).run_for(before, manifest)
