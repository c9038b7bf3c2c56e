"""Our GGUF writer (models/hf/gguf_file.py) against llama.cpp's own converter: for the same LLaDA and Dream layout
folders, `convert_hf_to_gguf.py` of the llama-cpp-python sdist (kept beside the CLI that deploy/llama_cpp.py
builds, "llama_cpp" in this file's name starts that build in the background) must write the same keys, the same
values, tensor names, types, shapes and bytes (the Q/K permutation included), so that drift on either side shows.

Two things are given to the converter, each the reason we write the file ourselves: the name of the pre-tokenizer
(it recognises a BPE pre-tokenizer by the hash of a fixed text's encoding, and a tokenizer our data prep trained is
not among its hashes: we pass the name our writer chose), and no SentencePiece model (Dream's conversion tries one
first and only falls back when the file is missing; sentencepiece is not installed here). Two values differ on
purpose: `general.name` (the converter's is made from the folder's name) and LLaDA's
`tokenizer.ggml.add_bos_token` (our tokenizers start no prompt with a BOS; docs/engines.md); and ours has a chat
template where the tokenizer has none (one that renders the prompt as it is)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import llama_cpp_prebuild
import numpy as np
import pytest
from conftest import skip_or_fail
from helpers import tiny_config, tiny_hf_model

from deploy import llama_cpp
from difflm.models.hf import engines
from difflm.models.hf.gguf_file import GGUF_FILE, PLAIN_TEMPLATE, write_gguf

pytestmark = pytest.mark.integration

# runs the sdist's converter with the two things it is told (this module's docstring); argv: folder, pre, out
CONVERT = """
import runpy, sys
folder, pre, out = sys.argv[1:4]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
def no_sentencepiece(self):
    raise FileNotFoundError("no tokenizer.model")
base.TextModel._set_vocab_sentencepiece = no_sentencepiece
sys.argv = ["convert_hf_to_gguf.py", folder, "--outfile", out, "--outtype", "f32"]
runpy.run_path(base.__file__.rsplit("/conversion/", 1)[0] + "/convert_hf_to_gguf.py", run_name="__main__")
"""
ON_PURPOSE = {"general.name", "tokenizer.ggml.add_bos_token"}
TEMPLATE = "tokenizer.chat_template"


@pytest.fixture(scope="module")
def converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py, kept beside the CLI built in the background since collection; the build
    or the download failing skips the test, and fails it under CI (`make test`)."""
    waited = llama_cpp_prebuild.wait()
    try:
        llama_cpp.build()
    except (llama_cpp.LlamaCppUnavailable, OSError) as err:
        skip_or_fail(f"llama.cpp was not built: {err}" + (f"; {waited}" if waited else ""))
    return llama_cpp.converter()


def _fields(path: Path) -> dict:
    return {
        k: (f.types, f.contents()) for k, f in gguf.GGUFReader(str(path)).fields.items() if not k.startswith("GGUF.")
    }


@pytest.mark.slow(reason="waits for the background llama.cpp build (about 4 min on 2 cores) when it is not cached")
@pytest.mark.parametrize("mode, groups, tied", [("difflm-noshift", 1, False), ("difflm-shift", 2, True)])
def test_our_gguf_equals_what_llama_cpps_converter_writes(converter, tiny_manifest, tmp_path, mode, groups, tied):
    tokens = tiny_manifest.tokenizer.to_dict()
    cfg = tiny_config(  # test-tiny at the random model's shapes (hidden 32, 2 layers, 2 heads, MLP 64)
        tmp_path,
        f"diffusion.model_running_mode={mode}",
        f"model.num_query_groups={groups}",
        f"model.tie_embeddings={str(tied).lower()}",
        "model.ffn_hidden_size=64",
    )
    layout = engines.layout_for(cfg, "gguf")
    model = tiny_hf_model(mode, vocab=tokens["vocab_size"], num_key_value_heads=groups, tie_word_embeddings=tied)
    ours = {k: v.detach() for k, v in model.state_dict().items()}
    sd = engines.layout_weights(layout, ours, cfg, tokens["vocab_size"])
    config = engines.layout_config(layout, cfg, tokens)
    folder = tmp_path / "layout"
    folder.mkdir()
    engines.write_layout(folder, sd, config, Path(tokens["path"]), tokens)
    pre = write_gguf(folder, layout, config, sd, tmp_path / GGUF_FILE)["gguf"]["pre_tokenizer"]

    theirs = tmp_path / "converter.gguf"
    env = {**os.environ, "PYTHONPATH": f"{converter.parent}:{converter.parent / 'gguf-py'}"}
    done = subprocess.run(
        [sys.executable, "-c", CONVERT, str(folder), pre, str(theirs)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]

    a, b = _fields(tmp_path / GGUF_FILE), _fields(theirs)
    # a tokenizer without a chat template gets one that renders the prompt as it is (the CLI would wrap it in
    # ChatML): the converter writes none then
    assert a.pop(TEMPLATE)[1] == PLAIN_TEMPLATE and TEMPLATE not in b
    assert set(a) == set(b), f"keys only ours: {set(a) - set(b)}, only the converter's: {set(b) - set(a)}"
    assert {k for k in a if a[k] != b[k]} <= ON_PURPOSE, {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    ta, tb = gguf.GGUFReader(str(tmp_path / GGUF_FILE)).tensors, gguf.GGUFReader(str(theirs)).tensors
    ours_t = {t.name: (t.tensor_type, list(t.shape), np.asarray(t.data)) for t in ta}
    theirs_t = {t.name: (t.tensor_type, list(t.shape), np.asarray(t.data)) for t in tb}
    assert set(ours_t) == set(theirs_t)
    for name, (kind, shape, data) in theirs_t.items():
        assert (ours_t[name][0], ours_t[name][1]) == (kind, shape), name
        assert np.array_equal(ours_t[name][2], data), f"{name}: the values differ (a permutation?)"
