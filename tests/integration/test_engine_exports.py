"""Trained checkpoints in the engines' layouts: the masked run (difflm-noshift) in LLaDA's and as GGUF, the shifted
run (difflm-shift) in Dream's, by `difflm convert --format` and by the pipeline's `export.formats`; each export's
logits against megatron's (the layout's reference forward, models/hf/engines.py) recorded in its marker.

The shared trained runs (conftest `trained`: "masked", "shift") are reused; llama.cpp running these files is
tests/integration/test_llama_cpp.py."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from safetensors.torch import load_file

from difflm.flows import commands
from difflm.models.evaluation.stages import EvaluationError, convert_checkpoint, load_model
from difflm.models.hf.convert import ConversionError
from difflm.models.hf.engines import GGUF_FILE, export_engine
from difflm.models.hf.export import Export
from difflm.models.hf.importer import PARITY_TOLERANCE

pytestmark = pytest.mark.integration


def test_llada_and_gguf_exports_of_the_masked_run(trained, tiny_manifest, tmp_path, capsys):
    run = trained("masked")
    cfg, ckpt = run.cfg, run.info.checkpoint
    # the default folder beside the run's other exports, reused the second time
    assert commands.convert(cfg, str(run.info.run.path), None, False, "llada") == 0
    printed = capsys.readouterr().out
    out = run.info.run.path / "exports" / f"{ckpt.name}-llada"
    assert f"Hugging Face export: {out}" in printed and "layout: LLaDAModelLM (llada)" in printed
    export = Export.read(out)
    assert (export.format, export.checkpoint, export.mode) == ("llada", str(ckpt), "difflm-noshift")
    assert export.parity is not None and export.parity <= PARITY_TOLERANCE
    assert f"= {export.parity:.2e} on 2 x 32 tokens" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LLaDAModelLM"] and config["model_type"] == "llada"
    assert config["mask_token_id"] == tiny_manifest.tokenizer.mask_id
    assert config["vocab_size"] == tiny_manifest.tokenizer.vocab_size  # megatron's padding rows are no token
    assert json.loads((out / "tokenizer_config.json").read_text())["mask_token"] == cfg.tokenizer.mask_token
    names = set(load_file(str(out / "model.safetensors")))
    assert {"model.transformer.wte.weight", "model.transformer.blocks.1.ff_proj.weight"} <= names
    commands.convert(cfg, str(run.info.run.path), None, False, "llada")
    assert "(reused)" in capsys.readouterr().out

    # gguf: the same layout, and model.gguf read back equal
    gg = tmp_path / "gguf"
    commands.convert(cfg, str(ckpt), str(gg), False, "gguf")
    assert "llama.cpp architecture llada, pre-tokenizer gpt-2" in capsys.readouterr().out
    marker = Export.read(gg).to_marker()
    assert marker["gguf"]["readback_max_abs_diff"] == 0.0 and marker["parity"] == pytest.approx(export.parity)
    reader = gguf.GGUFReader(str(gg / GGUF_FILE))
    assert reader.fields["tokenizer.ggml.mask_token_id"].contents() == tiny_manifest.tokenizer.mask_id
    embd = {t.name: np.asarray(t.data) for t in reader.tensors}["token_embd.weight"]
    assert np.array_equal(embd, load_file(str(out / "model.safetensors"))["model.transformer.wte.weight"].numpy())

    # our evaluation and sampler take our own export, and say so for an engine's
    with pytest.raises(EvaluationError, match="is a llada export for another engine"):
        load_model(out)

    # a layout that cannot hold the mode: one line, nothing written
    with pytest.raises(ConversionError, match=r"--format dream holds difflm-shift models, .*: use --format llada"):
        commands.convert(cfg, str(ckpt), str(tmp_path / "dream"), False, "dream")
    assert not (tmp_path / "dream").exists()


def test_dream_exports_of_the_shifted_run_by_convert_and_by_the_pipeline(trained, tiny_manifest, tmp_path):
    run = trained("shift")
    cfg, ckpt = run.cfg, run.info.checkpoint
    export = export_engine(cfg, tiny_manifest.tokenizer.to_dict(), ckpt, tmp_path / "dream", "dream")
    assert export.format == "dream" and export.parity <= PARITY_TOLERANCE
    config = json.loads((tmp_path / "dream" / "config.json").read_text())
    assert config["architectures"] == ["DreamModel"] and config["mask_token_id"] == tiny_manifest.tokenizer.mask_id
    sd = load_file(str(tmp_path / "dream" / "model.safetensors"))
    assert not sd["model.layers.0.self_attn.k_proj.bias"].any()  # the Llama's Q/K/V have none: zero, the same function

    # the pipeline's convert stage with export.formats: <run>/engines/gguf beside its own export, then reused
    with_gguf = cfg.model_copy(update={"export": cfg.export.model_copy(update={"formats": ["gguf"]})})
    convert_checkpoint(with_gguf, tiny_manifest, run.info)
    written = Export.read(run.info.run.engine_export("gguf"))
    assert written.format == "gguf" and written.extra["gguf"]["architecture"] == "dream"
    assert written.parity == pytest.approx(export.parity) and written.is_of(ckpt)
    stamp = (run.info.run.engine_export("gguf") / GGUF_FILE).stat().st_mtime_ns
    convert_checkpoint(with_gguf, tiny_manifest, run.info)
    assert (run.info.run.engine_export("gguf") / GGUF_FILE).stat().st_mtime_ns == stamp
    reader = gguf.GGUFReader(str(run.info.run.engine_export("gguf") / GGUF_FILE))
    assert "diffusion.shift_logits" not in reader.fields  # the CLI's default: Dream's shift
