"""Trained checkpoints in the engines' layouts: the masked run (difflm-noshift) in LLaDA's with its GGUF file by
`difflm convert --format gguf`, the shifted run (difflm-shift) in Dream's with its GGUF file by the pipeline's
`export.formats`; each export's logits against megatron's (the layout's reference forward, models/hf/engines.py)
recorded in its marker. (--format llada and dream write the same folders without model.gguf: same code path.)

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
from difflm.models.hf.engines import GGUF_FILE
from difflm.models.hf.export import Export
from difflm.models.hf.importer import PARITY_TOLERANCE

pytestmark = pytest.mark.integration


@pytest.mark.slow(reason="trains the shared masked test-tiny run (about 40 s) when no test before it has")
def test_llada_layout_and_gguf_of_the_masked_run(trained, tiny_manifest, tmp_path, capsys):
    run = trained("masked")
    cfg, ckpt = run.cfg, run.info.checkpoint
    # --format gguf: LLaDA's layout and its GGUF file, in the default folder beside the run's other exports
    assert commands.convert(cfg, str(run.info.run.path), None, False, "gguf") == 0
    printed = capsys.readouterr().out
    out = run.info.run.path / "exports" / f"{ckpt.name}-gguf"
    assert f"Hugging Face export: {out}" in printed and "layout: LLaDAModelLM (gguf)" in printed
    assert "llama.cpp architecture llada, pre-tokenizer gpt-2" in printed
    export = Export.read(out)
    assert (export.format, export.checkpoint, export.mode) == ("gguf", str(ckpt), "difflm-noshift")
    assert export.parity is not None and export.parity <= PARITY_TOLERANCE
    assert f"= {export.parity:.2e} on 2 x 32 tokens" in printed
    assert export.extra["gguf"]["readback_max_abs_diff"] == 0.0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LLaDAModelLM"] and config["model_type"] == "llada"
    assert config["mask_token_id"] == tiny_manifest.tokenizer.mask_id
    assert config["vocab_size"] == tiny_manifest.tokenizer.vocab_size  # megatron's padding rows are no token
    assert json.loads((out / "tokenizer_config.json").read_text())["mask_token"] == cfg.tokenizer.mask_token
    weights = load_file(str(out / "model.safetensors"))
    assert {"model.transformer.wte.weight", "model.transformer.blocks.1.ff_proj.weight"} <= set(weights)
    reader = gguf.GGUFReader(str(out / GGUF_FILE))
    assert reader.fields["tokenizer.ggml.mask_token_id"].contents() == tiny_manifest.tokenizer.mask_id
    assert reader.fields["diffusion.shift_logits"].contents() is False
    embd = {t.name: np.asarray(t.data) for t in reader.tensors}["token_embd.weight"]
    assert np.array_equal(embd, weights["model.transformer.wte.weight"].numpy())
    commands.convert(cfg, str(run.info.run.path), None, False, "gguf")
    assert "(reused)" in capsys.readouterr().out

    # our evaluation and sampler take our own export, and say so for an engine's
    with pytest.raises(EvaluationError, match="is a gguf export for another engine"):
        load_model(out)
    # a layout that cannot hold the mode: one line, nothing written
    with pytest.raises(ConversionError, match=r"--format dream holds difflm-shift models, .*: use --format llada"):
        commands.convert(cfg, str(ckpt), str(tmp_path / "dream"), False, "dream")
    assert not (tmp_path / "dream").exists()


@pytest.mark.slow(reason="trains the shared shifted test-tiny run (about 40 s) when no test before it has")
def test_dream_layout_and_gguf_of_the_shifted_run_by_the_pipelines_export_formats(trained, tiny_manifest):
    run = trained("shift")
    cfg, ckpt = run.cfg, run.info.checkpoint
    # the pipeline's convert stage with export.formats: <run>/engines/gguf beside its own export, then reused
    with_gguf = cfg.model_copy(update={"export": cfg.export.model_copy(update={"formats": ["gguf"]})})
    convert_checkpoint(with_gguf, tiny_manifest, run.info)
    out = run.info.run.engine_export("gguf")
    export = Export.read(out)
    assert export.format == "gguf" and export.extra["gguf"]["architecture"] == "dream" and export.is_of(ckpt)
    assert export.parity is not None and export.parity <= PARITY_TOLERANCE
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DreamModel"] and config["mask_token_id"] == tiny_manifest.tokenizer.mask_id
    weights = load_file(str(out / "model.safetensors"))
    assert not weights["model.layers.0.self_attn.k_proj.bias"].any()  # the Llama has none: zero, the same function
    stamp = (out / GGUF_FILE).stat().st_mtime_ns
    convert_checkpoint(with_gguf, tiny_manifest, run.info)
    assert (out / GGUF_FILE).stat().st_mtime_ns == stamp
    reader = gguf.GGUFReader(str(out / GGUF_FILE))
    assert "diffusion.shift_logits" not in reader.fields  # the CLI's default: Dream's shift
    assert reader.fields["general.architecture"].contents() == "dream"
