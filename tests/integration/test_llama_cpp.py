"""Our models in llama.cpp: a masked (difflm-noshift) model in the LLaDA layout and a shifted (difflm-shift) one in
the Dream layout (the shared runs, untied: helpers.TRAINED_MODES says why; their 4th step), written as GGUF by `difflm convert RUN --format gguf` and run by `llama-diffusion-cli` (built from
the llama-cpp-python sdist, deploy/llama_cpp.py: in the background from the start of the session,
tests/support/llama_cpp_prebuild.py), generate the tokens our sampler generates with the matching settings.

Which settings match (deploy/llama_cpp.py, docs/engines.md): llama.cpp's `--temp 0` is not greedy (its default
top-k 40 / top-p 0.95 chain then draws from the seed); `--top-k 1` is the argmax, and then every confidence it
ranks by is 1, so its confidence, entropy and margin algorithms all commit the leftmost masked positions: our
`remasking="left_to_right"`. Its block schedule (`--diffusion-block-length`, LLaDA's) is our `block_length` with
equal shares per step; its timestep schedule (`--diffusion-eps`, Dream's) is our `eps`.

How the tokens are compared: the CLI prints text only (no flag prints ids), and detokenizing then retokenizing is
lossy (a BPE text has several tokenizations), so our ids are decoded by our tokenizer and compared with its text;
the prompt goes in as text to both (llama.cpp adds BOS when the GGUF says so, and so do we, `prompt_ids`). Equal
texts from different ids would need two id sequences that decode alike, which greedy argmax of the same logits
does not produce by chance; a different token anywhere changes the text."""

from __future__ import annotations

import llama_cpp_prebuild
import pytest
import torch
from conftest import skip_or_fail

from deploy import llama_cpp
from difflm.models.evaluation.stages import load_model, load_tokenizer
from difflm.models.hf.convert import export_hf
from difflm.models.hf.engines import GGUF_FILE, export_engine

pytestmark = pytest.mark.integration

PROMPT = "the cat sat on"  # words of the demo corpus: a few tokens, shorter than a block


@pytest.fixture(scope="module")
def diffusion_cli():
    """llama.cpp's CLI, built in the background since collection (waited for here), else built now; the build or
    the download failing skips the tests, and fails them under CI (`make test`)."""
    waited = llama_cpp_prebuild.wait()
    try:
        return llama_cpp.build()
    except (llama_cpp.LlamaCppUnavailable, OSError) as err:
        skip_or_fail(f"llama.cpp was not built: {err}" + (f"; {waited}" if waited else ""))


def _engine_export(trained, tiny_manifest, tmp_path_factory, mode: str):
    """(our HF export, the GGUF) of the 4th step's checkpoint of the shared trained run of `mode`: the earliest one
    kept, whose words still depend on their position (after 16 steps these models repeat one or two words)."""
    run = trained(mode)
    checkpoint, tokenizer = run.info.run.checkpoint(4), tiny_manifest.tokenizer.to_dict()
    out = tmp_path_factory.mktemp(f"engines-{mode}")
    ours = export_hf(run.cfg, tokenizer, checkpoint, out / "hf", {"mode": run.cfg.diffusion.model_running_mode})
    export_engine(run.cfg, tokenizer, checkpoint, out / "gguf", "gguf")
    return ours.folder, out / "gguf" / GGUF_FILE


def _ours(folder, gguf, length: int, settings) -> tuple[str, list[int]]:
    """Our model's continuation of PROMPT on llama.cpp's canvas (`length` positions, the prompt's included), as
    the CLI prints text (our tokenizer's decoding without special tokens, then llama.cpp's space clean-up), and its
    ids."""
    model, tok = load_model(folder), load_tokenizer(folder)
    meta = llama_cpp.gguf_metadata(gguf)
    ids = llama_cpp.prompt_ids(meta, tok.encode(PROMPT, add_special_tokens=False))
    llama_cpp.check_canvas(len(ids), length, settings.steps, settings.block_length)
    seq = model.diffusion_generate(torch.tensor([ids]), length - len(ids), settings.steps, settings=settings)
    new = seq[0, len(ids) :].tolist()
    assert model.config.mask_token_id not in new  # llama.cpp could keep a mask it predicts; ours never does
    return llama_cpp.our_text(tok, meta, new), new


@pytest.mark.slow(
    reason="waits for the background llama.cpp build (about 4 min on 2 idle cores from collection, seconds when "
    "cached) and trains a shared untied test-tiny run (about 40 s) when no test before it has"
)
@pytest.mark.parametrize(
    ("mode", "layout", "schedule"),
    [
        ("masked-untied", "llada", {"block_length": 16}),  # LLaDA: semi-autoregressive blocks
        ("shift", "dream", {"eps": 1e-3}),  # Dream: one block, the timestep schedule
    ],
)
def test_llama_cpp_generates_our_tokens_from_the_gguf(
    diffusion_cli, trained, tiny_manifest, tmp_path_factory, mode, layout, schedule
):
    ours_dir, gguf = _engine_export(trained, tiny_manifest, tmp_path_factory, mode)
    meta = llama_cpp.gguf_metadata(gguf)
    assert meta["architecture"] == layout and meta["shift_logits"] == (layout == "dream")
    length, steps = 48, 12
    settings = llama_cpp.matching_sampler(steps, **schedule)
    text, ids = _ours(ours_dir, gguf, length, settings)
    assert len(set(ids)) > 2  # words that depend on their position and on what was committed before
    for algorithm in ("confidence", "entropy", "margin"):  # all rank ties at --top-k 1: leftmost first
        got = llama_cpp.generate(gguf, PROMPT, length=length, steps=steps, algorithm=algorithm, exe=diffusion_cli,
                                 **schedule)  # fmt: skip
        assert got.text == text, (algorithm, got.argv, ids)
