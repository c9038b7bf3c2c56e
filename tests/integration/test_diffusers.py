"""diffusers' LLaDA2Pipeline + BlockRefinementScheduler generates from our block-diffusion export, loaded as users
load it (`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`), the same tokens as our own block
sampler (`difflm generate` and the `generate_continuation` it calls) with the equivalent settings, greedy. The
mapping of the pipeline's arguments onto `eval.sampler.*` is docs/engines.md#diffusers; `equivalent_sampler` below
is that table in code. diffusers is a dev dependency: without it this module fails to import (a failure, not a
skip)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import BlockRefinementScheduler, LLaDA2Pipeline
from helpers import ROOT, tiny_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from difflm.models.diffusion import MaskedSampler
from difflm.models.evaluation.stages import convert_checkpoint
from difflm.models.hf.convert import hf_config, save_export
from difflm.models.hf.export import Export
from difflm.models.hf.modeling_difflm import DiffLMForMaskedLM

PROMPT = "The Academy Awards are the"
MAX_LENGTH = 32  # test-tiny's train.seq_length: what `difflm generate` lets prompt and continuation fill


def load_pipeline(folder: Path) -> LLaDA2Pipeline:
    """The pipeline as its documentation builds it, on our export folder."""
    model = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True, local_files_only=True)
    pipe = LLaDA2Pipeline(model=model.eval(), scheduler=BlockRefinementScheduler(), tokenizer=tokenizer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_run(pipe: LLaDA2Pipeline, ids: torch.Tensor, gen_length: int, steps: int, threshold: float | None):
    """(generated ids, text) of the pipeline, greedy; `threshold` None commits by the schedule alone."""
    out = pipe(
        input_ids=ids,
        use_chat_template=False,
        gen_length=gen_length,
        block_length=pipe.model.config.objective["block_size"],
        num_inference_steps=steps,
        temperature=0.0,
        sampling_method="greedy",
        threshold=1.0 if threshold is None else threshold,  # no confidence exceeds 1: the schedule's top-k only
        editing_threshold=None,  # ours never rewrites a committed token
        eos_early_stop=False,
    )
    return out.sequences[0].tolist(), out.texts[0]


def equivalent_sampler(gen_length: int, block_length: int, steps: int, threshold: float | None) -> MaskedSampler:
    """Our block sampler's settings for the pipeline's (gen_length, block_length, num_inference_steps, threshold):
    its steps count over the whole generation (a block gets ceil(steps * block / gen_length)); no KV cache, as the
    pipeline reruns the finished blocks at every step (the cache gives the same tokens up to float rounding)."""
    return MaskedSampler(
        steps=steps * gen_length // block_length,
        threshold=threshold,
        temperature=0.0,
        stop_at_eos=False,
        kv_cache=False,
    )


def prompt_and_length(pipe: LLaDA2Pipeline) -> tuple[torch.Tensor, int]:
    """The prompt's ids and the longest continuation that ends on a block boundary within MAX_LENGTH (the
    pipeline would otherwise decode the padding of the last block too)."""
    ids = pipe.tokenizer.encode(PROMPT, add_special_tokens=False)
    block = pipe.model.config.objective["block_size"]
    return torch.tensor([ids]), MAX_LENGTH // block * block - len(ids)


def difflm_generate(folder: Path, workdir: Path, gen_length: int, *overrides: str) -> dict:
    """The one record of `difflm generate FOLDER --prompt PROMPT --json` (a subprocess, as a user runs it)."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    args = ["generate", str(folder), "--prompt", PROMPT, "--max-new-tokens", str(gen_length), "--json", *overrides]
    out = subprocess.run(
        [sys.executable, "-m", "difflm.flows.cli", *args, "--preset", "test-tiny", f"workdir={workdir}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = json.loads(out.stdout[out.stdout.index("[") :])
    return record


@pytest.mark.slow(
    reason="pays for the shared difflm-block run when it asks first (data prep, torchrun, 16 steps, export), then "
    "`difflm generate` in a subprocess"
)
def test_llada2_pipeline_generates_our_tokens_from_a_trained_block_export(trained, tiny_manifest, tmp_path):
    run = trained("block")  # the shared difflm-block run (block_size 8)
    folder = convert_checkpoint(run.cfg, tiny_manifest, run.info).folder
    pipe = load_pipeline(folder)
    ids, n = prompt_and_length(pipe)
    tokens, text = pipeline_run(pipe, ids, n, steps=4, threshold=None)
    assert len(tokens) == n and pipe.model.config.mask_token_id not in tokens

    settings = equivalent_sampler(n, 8, 4, None)
    pad = pipe.model.config.pad_token_id
    ours = pipe.model.generate_continuation(ids, n, settings, forbidden_ids=(pad,))[0, ids.shape[1] :].tolist()
    assert ours == tokens
    # `difflm generate`'s default keeps the exact KV cache: the same tokens on this model
    cached = pipe.model.generate_continuation(ids, n, dataclasses.replace(settings, kv_cache=True))
    assert cached[0, ids.shape[1] :].tolist() == tokens
    overrides = [
        f"eval.sampler.steps={settings.steps}",
        "eval.sampler.kv_cache=false",
        "eval.sampler.stop_at_eos=false",
    ]
    record = difflm_generate(folder, tmp_path / "wd", n, *overrides)
    assert record["completion"] == text and record["sampler"]["steps"] == settings.steps


@pytest.fixture(scope="module")
def block_exports(tmp_path_factory, tiny_manifest) -> dict[str, Path]:
    """Random-weight difflm-block exports (blocks of 4) of each attention and prediction recipe, written as the
    pipeline writes them: their greedy continuations vary from token to token, so a wrong attention rule, shift or
    commit order shows in the tokens (the short trained run repeats one token)."""
    root = tmp_path_factory.mktemp("block-exports")
    recipes = {
        "block_causal": [],
        "token_causal": ["diffusion.clean_attention=token_causal"],
        "block_shift": ["diffusion.block_shift=true"],
    }
    out = {}
    for name, extra in recipes.items():
        cfg = tiny_config(root, "diffusion.model_running_mode=difflm-block", "diffusion.block_size=4", *extra)
        torch.manual_seed(0)
        config = hf_config(cfg, tiny_manifest.tokenizer.to_dict())
        config.initializer_range = 0.3  # varied continuations, confidences spread over 0.05-0.5 (no near ties)
        model = DiffLMForMaskedLM(config).eval()
        written = Export(root / name, None, mode="difflm-block", data_hash=tiny_manifest.hash)
        out[name] = save_export(model, Path(tiny_manifest.tokenizer.path), written).folder
    return out


@pytest.mark.parametrize("recipe", ["block_causal", "token_causal", "block_shift"])
@pytest.mark.parametrize(("steps", "threshold"), [(2, None), (4, 0.1)], ids=["schedule", "threshold"])
def test_llada2_pipeline_matches_our_block_sampler_on_every_recipe(block_exports, recipe, steps, threshold):
    """Schedule: `steps` commits per block by confidence. Threshold: every position above it, at least one per
    step: the pipeline's num_inference_steps = block_length (one commit owed per step) is our threshold rule."""
    pipe = load_pipeline(block_exports[recipe])
    ids, n = prompt_and_length(pipe)
    pipe_steps = 4 if threshold is not None else steps
    tokens, _ = pipeline_run(pipe, ids, n, pipe_steps, threshold)
    assert len(set(tokens)) >= 6, tokens  # a continuation that tells orders apart
    settings = equivalent_sampler(n, 4, pipe_steps, threshold)
    pad, stats = pipe.model.config.pad_token_id, {}
    ours = pipe.model.generate_continuation(ids, n, settings, forbidden_ids=(pad,), stats=stats)
    assert ours[0, ids.shape[1] :].tolist() == tokens
    if threshold is not None:  # the threshold committed several tokens in a step: fewer calls than tokens
        assert stats["nfe"] < n, stats
