"""Stock transformers checkpoints in and out: tiny random Llama (MHA and GQA, tied and untied), Qwen2
(q/k/v bias), Qwen3 (qk-norm, head_dim apart from hidden/heads), Mistral and Gemma (GELU-tanh, (1 + w) norms,
scaled embeddings), built here; the import gives
transformers' logits at every TP/PP layout, the stock export gives them back, and bad input says what to do."""

import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from helpers import tiny_hf_model
from hf_stock import KINDS, VOCAB, tiny_stock, tiny_tokenizer
from megatron.core import dist_checkpointing
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from difflm.config import load_config
from difflm.data_prep.pipeline import prepare_data
from difflm.models.diffusion.arch import ModelArch
from difflm.models.diffusion.modes import build_objective
from difflm.models.evaluation.stages import convert_checkpoint, export_stock_class
from difflm.models.hf import importer
from difflm.models.hf.architectures import Shape, architecture_of, stock_problem, stock_to_ours
from difflm.models.hf.convert import ConversionError, _local_key, export_hf, load_hf, repad_vocab
from difflm.models.hf.export import Export
from difflm.models.hf.importer import (
    export_stock,
    import_pretrained,
    import_record,
    prepare_tokenizer,
    source_overrides,
)
from difflm.models.launch.torchrun import free_port, launch_training, read_metrics
from difflm.models.megatron.gpt import build_model, padded_vocab_size
from difflm.rundir import RunDir, TrainResult

ROOT = Path(__file__).resolve().parents[4]
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: one thread is faster (tests/conftest.py)


def _cfg(tmp_path, folder, *extra):
    return tiny_config(tmp_path, *source_overrides(folder), "diffusion.model_running_mode=ar", *extra)


def _hf_logits(folder, ids):
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).float().eval()
    with torch.no_grad():
        return model(ids).logits


def _rel(ref, got):
    n = ref.shape[-1]
    return float((got[..., :n] - ref).abs().max() / ref.abs().max())


@pytest.mark.integration  # megatron's checkpoint writer starts processes
@pytest.mark.parametrize("kind", list(KINDS))
def test_import_then_stock_export_give_the_source_logits(tmp_path, kind):
    """HF -> megatron (parity checked inside, recorded) -> stock class without remote code, and -> our class (as
    an `ar` export of our own code, which must carry bias, qk-norm and head_dim): each gives the source's logits."""
    reserved = "<|mask|>" if kind == "mistral" else None  # a spare token of the vocabulary becomes the mask
    src = tiny_stock(kind, tmp_path / "src", reserved=reserved)
    cfg = _cfg(tmp_path, src)
    ckpt = import_pretrained(cfg, src, tmp_path / "mg")
    rec = import_record(ckpt)
    assert rec["architecture"] == type(AutoModelForCausalLM.from_pretrained(str(src))).__name__
    assert rec["parity"]["rel_max_logit_diff"] <= 1e-4
    tok = rec["tokenizer"]
    assert tok["mask_added"] == (reserved is None)
    assert tok["mask_id"] == VOCAB - 1 if reserved else VOCAB  # reused, or a new id after the vocabulary
    assert tok["vocab_size"] == VOCAB + (reserved is None)
    assert not list(tmp_path.glob("*.part"))

    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    ref = _hf_logits(src, ids)
    written = export_stock(cfg, tok, ckpt, tmp_path / "stock")
    # the stock class is checked against the megatron model when written, and its marker keeps the figure
    assert written == Export.read(tmp_path / "stock") and written.format == "hf-stock"
    assert 0 <= written.parity <= 1e-4 and written.extra["architecture"] == rec["architecture"]
    stock = written.folder
    config = json.loads((stock / "config.json").read_text())
    assert "auto_map" not in config and not list(stock.glob("*.py"))  # nothing to trust
    assert config["architectures"] == [rec["architecture"]] and config["difflm_mask_token_id"] == tok["mask_id"]
    assert _rel(ref, _hf_logits(stock, ids)) <= 1e-4

    ours = load_hf(export_hf(cfg, {**tok, "special_ids": []}, ckpt, tmp_path / "ours").folder)
    with torch.no_grad():
        assert _rel(ref, ours(ids).logits) <= 1e-4
    if kind == "mistral":  # a diffusion target with adaLN: the source's weights plus its own new parameters
        timed = _cfg(tmp_path, src, "diffusion.model_running_mode=difflm-shift", "diffusion.time_embedding=true")
        meta = dist_checkpointing.load_tensors_metadata(str(import_pretrained(timed, src, tmp_path / "mg-t")))
        assert any("modulation" in k for k in meta) and "decoder.final_layernorm.weight" in meta


@pytest.mark.slow
def test_import_at_tp_and_pp_gives_the_source_logits(tmp_path):
    """One torchrun of 4 ranks: every case at TP in {1,2} x PP in {1,2} gives transformers' logits."""
    cases = []
    for kind in KINDS:
        src = tiny_stock(kind, tmp_path / kind)
        ckpt = import_pretrained(
            _cfg(tmp_path, src, "parallel.tensor_model_parallel_size=2", "train.launch.nproc_per_node=2"),
            src,
            tmp_path / f"{kind}-mg",
        )
        ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
        torch.save({"ids": ids, "logits": _hf_logits(src, ids)}, tmp_path / f"{kind}.pt")
        overrides = [*source_overrides(src), "diffusion.model_running_mode=ar", f"workdir={tmp_path}"]
        vocab = import_record(ckpt)["tokenizer"]["vocab_size"]  # 97 pads to 128 rows at TP 1 and 2 alike
        cases.append(
            {"name": kind, "overrides": overrides, "vocab_size": vocab, "ckpt": {"1": str(ckpt), "2": str(ckpt)}}
        )
        cases[-1]["probe"] = str(tmp_path / f"{kind}.pt")
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(free_port()), str(ROOT / "tests" / "support" / "hf_parallel_worker.py")]
    proc = subprocess.run([*cmd, str(tmp_path / "cases.json"), str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = {p.stem: json.loads(p.read_text())["rel"] for p in out.glob("*.json")}
    assert len(got) == 4 * len(KINDS), sorted(got)
    print("max relative logit difference over layouts and cases:", max(got.values()))
    assert max(got.values()) <= 1e-4, got


def _write(folder: Path, **config):
    c = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**c, **config}))


BAD = {  # name -> (how the folder is spoiled, what the one line says)
    "architecture": (
        lambda f: _write(f, model_type="gpt2", architectures=["GPT2LMHeadModel"]),
        "GPT2LMHeadModel is not supported",
    ),
    "rope scaling": (
        lambda f: _write(f, rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}),
        "RoPE scaling 'llama3' is not implemented",
    ),
    "sliding window": (lambda f: _write(f, model_type="mistral", sliding_window=16), "sliding-window attention"),
    "post-norms": (lambda f: _write(f, model_type="gemma2"), "gemma2: norms after attention and MLP"),
    "activation": (lambda f: _write(f, hidden_act="gelu"), "hidden_act='gelu'.*LlamaForCausalLM is built with silu"),
    "no weights": (lambda f: (f / "model.safetensors").unlink(), "no weights"),
    "missing tokenizer": (lambda f: (f / "tokenizer.json").unlink(), "no tokenizer.json"),
    "vocab mismatch": (
        lambda f: tiny_tokenizer(f, VOCAB + 8),
        "the tokenizer has 104 tokens but the embedding only 96",
    ),
    "config mismatch": (lambda f: _write(f, vocab_size=128), "config.json says vocab_size 128"),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_input_says_what_to_do_and_writes_nothing(tmp_path, bad):
    src = tiny_stock("llama-gqa-untied", tmp_path / "src")
    cfg = _cfg(tmp_path, src)
    spoil, says = BAD[bad]
    spoil(src)
    with pytest.raises(ConversionError, match=says):
        import_pretrained(cfg, src, tmp_path / "mg")
    assert not (tmp_path / "mg").exists() and not list(tmp_path.glob("mg*"))


@pytest.mark.integration  # megatron's checkpoint writer starts processes
def test_sharded_folders_gguf_files_and_another_architecture_config(tmp_path):
    src = tiny_stock("qwen2-bias", tmp_path / "src", max_shard_size="20KB")
    shards = sorted(src.glob("model-*.safetensors"))
    assert len(shards) > 1 and (src / "model.safetensors.index.json").exists()
    cfg = _cfg(tmp_path, src)
    tok = prepare_tokenizer(src, tmp_path / "tok")  # as a data manifest records it (the adaptation flow's path)
    rec = import_record(import_pretrained(cfg, src, tmp_path / "mg", tokenizer=tok))
    assert rec["parity"]["rel_max_logit_diff"] <= 1e-4 and rec["tokenizer"]["path"] == str(tmp_path / "tok")
    assert not (tmp_path / "mg" / "tokenizer").exists()  # the caller's tokenizer is not copied
    with pytest.raises(ConversionError, match="the model config differs from the checkpoint .*qkv_bias"):
        import_pretrained(tiny_config(tmp_path), src, tmp_path / "other")  # no source overrides
    shards[0].unlink()
    with pytest.raises(ConversionError, match=f"names 1 missing shard.*{shards[0].name}"):
        import_pretrained(cfg, src, tmp_path / "mg2")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ConversionError, match="is a GGUF file, not an HF folder"):
        import_pretrained(cfg, gguf, tmp_path / "mg3")
    assert not list(tmp_path.glob("mg2*")) and not list(tmp_path.glob("mg3*")) and not (tmp_path / "other").exists()


@pytest.mark.integration  # the CLI in a subprocess
def test_difflm_convert_imports_a_stock_folder(tmp_path):
    """`difflm convert HF_DIR --out CKPT` on a stock folder: the checkpoint, its tokenizer with a mask token, and
    the overrides that train from it, which make a valid config, and the parity figure; a GGUF file gets its one
    line."""
    src = tiny_stock("qwen3-qknorm-hd", tmp_path / "src")
    cli = [sys.executable, "-m", "difflm.flows.cli", "convert"]
    proc = subprocess.run([*cli, str(src), "--out", str(tmp_path / "mg")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    use = shlex.split(proc.stdout.split("start training from it with: ")[1].splitlines()[0])  # quoted for the shell
    assert f"train.init_from={tmp_path / 'mg'}" in use and "model.kv_channels=12" in use
    parity = import_record(tmp_path / "mg")["parity"]  # the figure the import checked, printed, not only recorded
    assert f"parity: max |logit difference| / max |logit| = {parity['rel_max_logit_diff']:.2e}" in proc.stdout
    assert "tokenizer.mask_token=<|mask|>" in use and (tmp_path / "mg" / "tokenizer" / "tokenizer.json").exists()
    cfg = load_config("test-tiny", use)
    assert cfg.model.qk_layernorm and cfg.model.hf_architecture == "qwen3"
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    proc = subprocess.run([*cli, str(tmp_path / "m.gguf")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode != 0 and "is a GGUF file, not an HF folder" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.integration  # the CLI in a subprocess
def test_difflm_convert_refuses_a_folder_it_did_not_write_and_leaves_no_lock_there(tmp_path):
    """issue 50 item 6d: `--out` a folder difflm did not write (a megatron checkpoint of someone else's: its
    metadata.json; a folder of files) was taken as the import (a TypeError before) or refused with a `.NAME.lock`
    left in the user's folder. Refused in one line before anything is written, the user's folder as it was."""
    src = tiny_stock("qwen3-qknorm-hd", tmp_path / "src")
    user = tmp_path / "user"
    (user / "theirs").mkdir(parents=True)
    (user / "theirs" / "metadata.json").write_text("{}")
    (user / "mine").mkdir()
    (user / "mine" / "thesis.tex").write_text("precious")
    for name in ("theirs", "mine"):
        proc = subprocess.run(
            [sys.executable, "-m", "difflm.flows.cli", "convert", str(src), "--out", str(user / name)],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert len(proc.stderr.strip().splitlines()) == 1 and "nothing was written" in proc.stderr, proc.stderr
        assert "start training from it" not in proc.stdout
    assert sorted(p.name for p in user.iterdir()) == ["mine", "theirs"]  # no .mine.lock, no .theirs.lock
    assert [f.name for f in (user / "theirs").iterdir()] == ["metadata.json"]
    assert (user / "mine" / "thesis.tex").read_text() == "precious" and len(list((user / "mine").iterdir())) == 1


def test_an_ar_run_exports_the_stock_class_that_lm_eval_scores(megatron_single_process, tmp_path, tiny_manifest):
    """The pipeline's export stage of an `ar` run also writes <run>/hf-stock: a Llama (trained here, so no recorded
    architecture) that AutoModelForCausalLM loads without remote code, giving the megatron model's logits (checked
    inside), and that lm-eval's stock `hf` model scores; a diffusion run writes none."""
    # lm-eval is an optional back-end: only this test loads it
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    cfg = tiny_config(tmp_path, "diffusion.model_running_mode=ar", "model.num_query_groups=1")
    torch.manual_seed(0)
    model = build_model(cfg, tiny_manifest.tokenizer.vocab_size, objective=build_objective(cfg.diffusion))
    ckpt = tmp_path / "run" / "checkpoints" / "iter_0000001"
    ckpt.mkdir(parents=True)
    dist_checkpointing.save(model.sharded_state_dict(prefix=""), str(ckpt))
    info = TrainResult(RunDir(tmp_path / "run"), ckpt, reused=False)
    export = export_stock_class(cfg, tiny_manifest, info)
    stock = export.folder
    assert stock == tmp_path / "run" / "hf-stock" and export == Export.read(stock)
    assert (export.format, export.mode, export.data_hash) == ("hf-stock", "ar", tiny_manifest.hash)
    assert type(AutoModelForCausalLM.from_pretrained(str(stock))).__name__ == "LlamaForCausalLM"
    assert json.loads((stock / "difflm_export.json").read_text())["parity"] == export.parity <= 1e-4
    lm = HFLM(pretrained=str(stock), device="cpu", batch_size=1)
    req = Instance(request_type="loglikelihood", doc={}, arguments=("The history of", " the city"), idx=0)
    ((logp, _greedy),) = lm.loglikelihood([req])
    assert logp < 0 and math.isfinite(logp)
    diffusion = tiny_config(tmp_path, "diffusion.model_running_mode=difflm-noshift")
    assert export_stock_class(diffusion, tiny_manifest, info) is None


@pytest.mark.slow
def test_training_starts_from_an_imported_qwen2(tmp_path):
    """The two steps a user takes: `difflm convert HF_DIR --out CKPT`, then training with the overrides it printed
    (data prep reads through the imported tokenizer with its mask token); the ar run's export stage writes the
    stock Qwen2 class back. Step 0's validation loss is the imported model's, so it differs from a fresh init's."""
    src = tiny_stock("qwen2-bias", tmp_path / "src")
    cli = [sys.executable, "-m", "difflm.flows.cli", "convert", str(src), "--out", str(tmp_path / "mg")]
    proc = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    use = shlex.split(proc.stdout.split("start training from it with: ")[1].splitlines()[0])
    run = ["diffusion.model_running_mode=ar", "train.train_iters=2", "train.schedule.warmup_iters=1"]
    run += ["train.eval_interval=2", "checkpoint.save_interval=2", "tracking.enabled=false"]
    starts = []
    for init in (use, [u for u in use if not u.startswith("train.init_from=")]):
        cfg = tiny_config(tmp_path / f"wd{len(starts)}", *init, *run)
        manifest = prepare_data(cfg)
        assert manifest.tokenizer.mask_id == VOCAB  # the added mask token
        info = launch_training(cfg, manifest, echo=lambda _: None)
        starts.append([r["val_loss"] for r in read_metrics(info.run.path) if r["step"] == 0 and "val_loss" in r][0])
        if len(starts) == 1:
            convert_checkpoint(cfg, manifest, info)
            config = json.loads((info.run.path / "hf-stock" / "config.json").read_text())
            assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert starts[0] != pytest.approx(starts[1], rel=1e-3)


@pytest.mark.integration  # saves a megatron checkpoint (its writer starts processes)
def test_an_imported_ar_model_has_the_sources_exact_nll(tmp_path):
    """A tiny Qwen2 of 96 rows gets a new mask token (97 tokens) and zero rows up to 128: megatron's `ar` loss (its
    per-token cross-entropy, as training and val_loss use) and the export's `ar_nll` normalise over the source's
    tokens only, so both give transformers' NLL, not one raised by the mass of the 32 rows the import added."""
    src = tiny_stock("qwen2-bias", tmp_path / "src")
    sd = load_file(str(src / "model.safetensors"))  # sharper logits, closer to a trained model's scale
    sd["model.norm.weight"] = sd["model.norm.weight"] * 4
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    cfg = _cfg(tmp_path, src)
    tok = importer.prepare_tokenizer(src, tmp_path / "tok", cfg.tokenizer.mask_token)
    vocab = tok["vocab_size"]
    rows = padded_vocab_size(vocab, 1)
    assert tok["mask_added"] and (vocab, rows) == (VOCAB + 1, 128)
    ours = stock_to_ours(importer.load_stock_weights(src), Shape.of(cfg.model), cfg.model.num_layers, True)
    weights = repad_vocab({_local_key(k): v for k, v in importer._resize_vocab(ours, vocab, True).items()}, rows)

    ids = torch.randint(3, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    lp = torch.log_softmax(_hf_logits(src, ids).double(), -1)
    nll_hf = -lp[:, :-1].gather(-1, ids[:, 1:, None]).mean().item()
    with importer.single_megatron(0):
        model = importer.megatron_model(
            importer._single(cfg, causal=True), vocab, rows, weights, never_targets=importer.added_rows(tok, VOCAB)
        )
        labels = torch.cat([ids[:, 1:], ids[:, :1]], 1)
        with torch.no_grad():
            ce = model(ids, torch.arange(32)[None].expand(4, 32), None, labels=labels).float()
    assert ce[:, :-1].mean().item() == pytest.approx(nll_hf, abs=1e-4)

    ckpt = importer.import_pretrained(cfg, src, tmp_path / "mg", tokenizer=tok)
    assert importer.import_record(ckpt)["tokenizer"]["mask_row_added"]  # what the adapt flow's source export reads
    export = load_hf(export_hf(cfg, {**tok, "special_ids": []}, ckpt, tmp_path / "ours").folder)
    assert export.ar_nll(ids).mean().item() == pytest.approx(nll_hf, abs=1e-4)


def test_each_row_sets_the_architecture_record(tmp_path):
    """A model trained here exports to the row whose switches it has (the defaults are a Llama's, Gemma's are
    GELU-tanh, (1 + w) norms, scaled embeddings); switches no row has, or another row's, say why."""

    def arch(*over):
        m = tiny_config(tmp_path, *over).model
        return architecture_of(m).name, stock_problem(m)

    assert arch() == ("llama", None)
    assert arch("model.qkv_bias=true") == ("qwen2", None)
    gemma = ("model.activation=gelu_tanh", "model.norm_offset=1", "model.embedding_scale=true", "model.kv_channels=8")
    assert arch(*gemma) == ("gemma", None)
    name, problem = arch("model.activation=gelu_tanh")
    assert name == "llama" and "no stock class has the switches" in problem
    name, problem = arch("model.hf_architecture=qwen2")
    assert name == "qwen2" and "model.hf_architecture=qwen2" in problem


def test_an_exports_record_gives_the_overrides_that_adapt_it(tmp_path):
    """`difflm adapt` of one of this project's exports reads its architecture record back into `model.*`."""
    # inside: the module imports the importer's function of the same name
    from difflm.tasks.adapt import source_overrides

    record = ModelArch(activation="gelu_tanh", norm_offset=1, embedding_scale=True, qk_norm=True, head_dim=24)
    tiny_hf_model(architecture=record.to_dict()).save_pretrained(str(tmp_path / "export"))
    tiny_tokenizer(tmp_path / "export", vocab=64)
    assert ModelArch.of(load_config("test-tiny", source_overrides(tmp_path / "export")).model) == record
