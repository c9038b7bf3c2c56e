"""Plain-function stages after training: export and evaluate (Prefect tasks wrap these)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from difflm.config import PipelineConfig
from models.evaluation.generation import DEFAULT_PROMPTS, generate_samples
from models.evaluation.likelihood import likelihood_bound, validation_windows
from models.hf.convert import export_hf, load_hf


def convert_checkpoint(cfg: PipelineConfig, manifest: dict, train_info: dict) -> Path:
    """The HF folder of the run's final checkpoint (reused when it was exported from that checkpoint)."""
    out = Path(train_info["run_dir"]) / "hf"
    marker = out / "difflm_export.json"
    if marker.exists() and json.loads(marker.read_text()).get("checkpoint") == train_info["checkpoint"]:
        return out
    provenance = {"data_hash": manifest["hash"], "mode": cfg.diffusion.model_running_mode}
    return export_hf(cfg, manifest["tokenizer"], Path(train_info["checkpoint"]), out, provenance)


def load_tokenizer(folder: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def evaluate_export(cfg: PipelineConfig, manifest: dict, hf_dir: Path) -> dict:
    """Likelihood bound of the trained and of an untrained (freshly initialised) model, and samples."""
    from models.hf.modeling_difflm import DiffLMForMaskedLM

    model = load_hf(hf_dir)
    windows = validation_windows(manifest, cfg.train.seq_length, cfg.eval.max_sequences)
    trained = likelihood_bound(model, windows, cfg)
    torch.manual_seed(cfg.train.seed)  # the same init distribution as training, weights never updated
    untrained = likelihood_bound(DiffLMForMaskedLM(model.config).eval(), windows, cfg)
    samples = generate_samples(model, load_tokenizer(hf_dir), cfg, DEFAULT_PROMPTS)
    results = {"bounds": {"trained": trained.to_dict(), "untrained": untrained.to_dict()}, "samples": samples}
    (hf_dir.parent / "eval").mkdir(exist_ok=True)
    (hf_dir.parent / "eval" / "results.json").write_text(json.dumps(results, indent=2))
    return results
