"""Correctness sections that need a trained checkpoint or two specs on the same weights: the HF export against
megatron's logits (fp32 and bf16), and the torch spec's first-step loss against the local spec's. Their workers
run under torchrun (runtime.worker).

megatron and the trainer are imported inside the functions: the main process imports this module before
the wheels' install (benchmarks/gpu/runtime.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.gpu.corpus import SPECIALS, SUCCESSORS, chain_fraction
from benchmarks.gpu.plan import config
from benchmarks.gpu.runtime import worker
from difflm.manifest import DataManifest

MARGIN = 1.0  # logits: a reference top-2 gap above this is a decided token (bf16 rounding is ~0.01-0.1)


def export(check, manifest: Path, trained: dict) -> dict:
    """Megatron's fp32 logits of the trained checkpoint (worker) against the HF export in fp32 and bf16, on a
    batch with half its tokens masked (the positions training scores; clean positions have near-ties that
    bf16 rounding flips). bf16 passes on the masked-token loss and on the top-1 of decided tokens."""
    from difflm.config import load_config
    from difflm.models.hf.convert import export_hf, load_hf
    from difflm.rundir import RunDir

    p, out = check.p, check.out
    run = RunDir(trained["run_dir"])
    cfg = load_config(str(out / "config-difflm-noshift.yaml"))
    ckpt = run.checkpoint(run.latest_iteration())
    ref = worker(check, "logits", manifest, checkpoint=ckpt, config=out / "config-difflm-noshift.yaml")
    man = DataManifest.read(manifest)
    folder = export_hf(cfg, man.tokenizer.to_dict(), ckpt, out / "hf").folder
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch = torch.load(ref["batch"])
    vocab = man.tokenizer.vocab_size
    tokens, clean, masked = batch["tokens"].to(device), batch["clean"].to(device), batch["masked"].to(device)
    ref_logits = batch["logits"].to(device)[..., :vocab]
    top2 = ref_logits.topk(2, dim=-1).values
    decided = masked & (top2[..., 0] - top2[..., 1] > MARGIN)
    ref_loss = F.cross_entropy(ref_logits[masked], clean[masked]).item()
    report = {
        "checkpoint": str(ckpt),
        "folder": str(folder),
        "masked_tokens": int(masked.sum()),
        "decided_tokens": int(decided.sum()),
        "megatron_masked_loss": ref_loss,
    }
    table = np.load(Path(man.dir) / "markov.npy")
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = load_hf(folder).to(device=device, dtype=dtype)
        with torch.no_grad():
            logits = model(tokens).logits.float()[..., :vocab]
        diff = (logits - ref_logits).abs()
        agree = logits.argmax(-1) == ref_logits.argmax(-1)
        loss = F.cross_entropy(logits[masked], clean[masked]).item()
        gen = torch.Generator().manual_seed(0)  # noise is drawn on the CPU (NOISE_DEVICE), on every device
        nll = model.elbo_nll(clean[:2], t_samples=4, generator=gen)
        nll = float(nll.float().mean()) if torch.is_tensor(nll) else float(nll)
        prompt = clean[:1, :8]
        with torch.no_grad():
            out_ids = model.diffusion_generate(prompt, length=p["sample_len"], steps=p["sample_len"])
        sample = out_ids[0, prompt.shape[1] :].tolist()
        report[name] = {
            "max_abs_diff": diff.max().item(),
            "mean_abs_diff": diff.mean().item(),
            "top1_agreement_masked": agree[masked].float().mean().item(),
            "top1_agreement_decided": agree[decided].float().mean().item() if decided.any() else None,
            "masked_loss": loss,
            "masked_loss_rel_diff": abs(loss - ref_loss) / max(abs(ref_loss), 1e-9),
            "elbo_nll": nll,
            "sample_chain_fraction": chain_fraction(sample, table),
            "sample": " ".join(f"w{t}" if t >= len(SPECIALS) else SPECIALS[t] for t in sample[:24]),
        }
        del model
    report["chance_chain_fraction"] = SUCCESSORS / (vocab - len(SPECIALS))
    report["fp32_parity_ok"] = report["fp32"]["max_abs_diff"] < 1e-3 * max(1.0, ref_logits.abs().max().item())
    bf16 = report["bf16"]
    report["bf16_parity_ok"] = bf16["masked_loss_rel_diff"] < 0.02 and (
        bf16["top1_agreement_decided"] is None or bf16["top1_agreement_decided"] >= 0.98
    )
    return report


def _init(cfg):
    from difflm.models.megatron.train import init_distributed

    init_distributed(cfg)


def worker_logits(args, p: dict) -> dict:
    """Megatron's fp32 logits of a checkpoint on a fixed validation batch with half its tokens masked."""
    from difflm.config import load_config
    from difflm.models.diffusion.modes import build_objective
    from difflm.models.megatron import checkpointing
    from difflm.models.megatron.data import build_datasets
    from difflm.models.megatron.gpt import build_model

    cfg = load_config(args.config, ["train.precision=fp32"])
    manifest = DataManifest.read(args.manifest)
    _init(cfg)
    _, valid = build_datasets(cfg, manifest, cfg.train.global_batch_size, 4 * cfg.train.global_batch_size)
    clean = torch.stack([valid[i]["tokens"][: min(256, cfg.train.seq_length)] for i in range(2)])
    masked = torch.rand(clean.shape, generator=torch.Generator().manual_seed(0)) < 0.5
    tokens = torch.where(masked, manifest.tokenizer.mask_id, clean)
    model = build_model(cfg, manifest.tokenizer.vocab_size, objective=build_objective(cfg.diffusion))
    if torch.cuda.is_available():
        model.cuda()
    checkpointing.load_model_weights(Path(args.checkpoint), model)
    model.eval()
    device = next(model.parameters()).device
    pos = torch.arange(tokens.shape[1], device=device)[None].expand(tokens.shape[0], -1)
    with torch.no_grad():
        logits = model(tokens.to(device), pos, None).float().cpu()
    path = Path(args.out) / "megatron-logits.pt"
    torch.save({"tokens": tokens, "clean": clean, "masked": masked, "logits": logits}, path)
    return {"batch": str(path)}


def worker_parity(args, p: dict) -> dict:
    """First-step loss of the same weights and batch on the local spec and the torch spec, fp32 and bf16."""
    from benchmarks.gpu.microbatch import append_row, free  # (the worker process: after the wheels' install)
    from difflm.models.diffusion.modes import build_objective
    from difflm.models.megatron.data import build_datasets
    from difflm.models.megatron.forward_step import SpecialTokens
    from difflm.models.megatron.train import build_training, run_global_batch

    manifest = DataManifest.read(args.manifest)
    out: dict = {}
    weights = None
    for precision in ("fp32", "bf16"):
        for backend in ("local", "torch"):
            cfg = config(
                p,
                Path(args.out) / "work",
                p["small"],
                p["seq"],
                "difflm-noshift",
                train={
                    "micro_batch_size": p["parity_mbs"],
                    "global_batch_size": p["parity_mbs"],
                    "precision": precision,
                },
            )
            cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"backend": backend})})
            if not out:
                _init(cfg)
                train_ds, _ = build_datasets(cfg, manifest, cfg.train.global_batch_size, cfg.train.global_batch_size)
                special = SpecialTokens.from_manifest(manifest.tokenizer)
            torch.manual_seed(0)
            objective = build_objective(cfg.diffusion, special.ids())
            ddp, _, _ = build_training(cfg, manifest.tokenizer.vocab_size, objective=objective)
            inner = ddp.module.module if precision == "bf16" else ddp.module  # Float16Module wraps in bf16
            if weights is None:
                weights = {
                    k: v.detach().float().cpu().clone() for k, v in inner.state_dict().items() if torch.is_tensor(v)
                }
            else:
                inner.load_state_dict(
                    {k: v.to(dtype=inner.state_dict()[k].dtype) for k, v in weights.items()}, strict=False
                )
            out[f"{backend}-{precision}"] = run_global_batch(
                cfg, ddp, train_ds, special, step=0, noise_step=0, objective=objective
            )
            append_row(args, {"spec": backend, "precision": precision, "loss": out[f"{backend}-{precision}"]})
            del ddp
            free()
    out["fp32_rel_diff"] = abs(out["torch-fp32"] - out["local-fp32"]) / abs(out["local-fp32"])
    out["bf16_rel_diff"] = abs(out["torch-bf16"] - out["local-bf16"]) / abs(out["local-bf16"])
    return out
