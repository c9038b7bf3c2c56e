"""TP=2, PP=2 and DP=2 (torchrun, gloo, CPU) give the loss of the single-process run on the same
weights and batch, for masked diffusion, uniform diffusion (its ELBO needs the full vocabulary: TP
gathers it) and the autoregressive baseline, over two optimizer steps; and the masked-token
normalisation gives the same loss whatever the micro-batch / data-parallel split. Block diffusion as well."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_config

from difflm.config import save_config
from difflm.models.launch.torchrun import free_port

LAYOUTS = {  # name: (processes, overrides)
    "tp2": (2, ["parallel.tensor_model_parallel_size=2"]),
    "pp2": (2, ["parallel.pipeline_model_parallel_size=2"]),
    "dp2": (2, []),
    "dp2-distopt": (2, ["parallel.use_distributed_optimizer=true"]),
    "tp2-distopt": (2, ["parallel.tensor_model_parallel_size=2", "parallel.use_distributed_optimizer=true"]),
}
TORCH_SPEC = {  # megatron-core layers on torch's attention kernels, and sequence parallelism on them
    "torch-spec": (1, ["model.backend=torch"]),
    "tp2-sp-torch": (
        2,
        ["model.backend=torch", "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
    ),
}
# case: (config overrides of the reference run, the layouts compared with it)
CASES = {
    "difflm-noshift": ([], LAYOUTS),
    "ar": (["diffusion.model_running_mode=ar"], LAYOUTS),
    "uniform-elbo": (
        ["diffusion.model_running_mode=difflm-noshift-uniform", "diffusion.time_embedding=true"],
        {**{k: LAYOUTS[k] for k in ("tp2", "pp2", "dp2")}, **TORCH_SPEC},
    ),
    # under SP the time embedding's gradients must be all-reduced across TP, or step 2 differs
    "time-input-sp": (
        ["diffusion.time_embedding=true", "diffusion.time_conditioning=input"],
        {"tp2-sp-torch": TORCH_SPEC["tp2-sp-torch"]},
    ),
    # block diffusion: [x_t | x_0] activations of 2L through the pipeline, its mask on both specs, AR term on TP
    "block": (
        [
            "diffusion.model_running_mode=difflm-block",
            "diffusion.block_size=4",
            "diffusion.clean_attention=token_causal",
            "diffusion.ar_loss_weight=1.0",
        ],
        {**{k: LAYOUTS[k] for k in ("tp2", "pp2", "dp2")}, **TORCH_SPEC},
    ),
    # AR-to-diffusion adaptation: CART weights and DiffuLLaMA's annealed mask (step 0 causal, step 1 drawn from
    # (seed, step): every TP/PP peer and DP rank must draw the same one)
    "adapt": (
        [
            "diffusion.model_running_mode=difflm-shift",
            "diffusion.loss_weighting=cart",
            "diffusion.attention_anneal_steps=4",
        ],
        {k: LAYOUTS[k] for k in ("tp2", "pp2", "dp2")},
    ),
    # the reference runs ONE micro-batch of 4; the others split it (a mean of per-micro-batch ratios gave 6.88 vs 7.88)
    "masked-tokens": (
        ["diffusion.normalize_by=masked_tokens", "train.micro_batch_size=4"],
        {"mbs2": (1, ["train.micro_batch_size=2"]), "dp2-mbs2": (2, ["train.micro_batch_size=2"])},
    ),
}


def _torchrun(nproc: int, args: list[str], cwd) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "-m",
        "difflm.models.megatron.parity",
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


BF16_BACKENDS = ("local", "torch")  # bf16 parameters everywhere (Float16Module), fp32 main weights


@pytest.fixture(scope="module")
def parity(session_dir, tiny_manifest, tmp_path_factory) -> Path:
    """Every case's runs, in two torchruns in all (models/megatron/parity.py --runs, a config and weights per run):
    one process runs each case's reference (it saves the weights its layouts load), the one-process layouts and
    the bf16 runs; then two processes run every two-process layout. A process start (torch and megatron imports,
    gloo) is about 8 s: one torchrun per case and world size was 16 of them, 142 s for the module on 2026-12-06.
    Each run's losses land in <case>/<layout>.json, which the tests below compare."""
    root = tmp_path_factory.mktemp("parity")
    manifest = root / "manifest.json"
    tiny_manifest.write(manifest)
    # 2 layers (PP=2 splits them), 2 heads (TP=2 splits them), global batch 4 = 2 micro-batches of 2
    common = ["train.micro_batch_size=2", "train.global_batch_size=4"]
    by_world: dict[int, list[dict]] = {1: [], 2: []}
    for case, (overrides, layouts) in CASES.items():
        folder = root / case
        folder.mkdir()
        cfg = tiny_config(session_dir / "parallel", *common, "diffusion.antithetic_t=true", *overrides)
        model = {"config": str(save_config(cfg, folder / "config.yaml")), "weights": str(folder / "weights")}
        # the reference first: it saves the weights every layout of its case loads
        by_world[1].append({**model, "out": str(folder / "ref.json"), "save": True})
        for name, (nproc, layout) in layouts.items():
            by_world[nproc].append({**model, "out": str(folder / f"{name}.json"), "overrides": layout})
    folder = root / "bf16"
    folder.mkdir()
    cfg = tiny_config(session_dir / "parallel", *common)
    model = {"config": str(save_config(cfg, folder / "config.yaml")), "weights": str(folder / "weights")}
    by_world[1].append({**model, "out": str(folder / "fp32.json"), "save": True})
    for backend in BF16_BACKENDS:
        overrides = ["train.precision=bf16", f"model.backend={backend}"]
        by_world[1].append({**model, "out": str(folder / f"{backend}.json"), "overrides": overrides})
    for nproc, runs in by_world.items():
        (root / f"runs{nproc}.json").write_text(json.dumps(runs))
        _torchrun(nproc, ["--manifest", str(manifest), "--runs", str(root / f"runs{nproc}.json")], root)
    return root


def _losses(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_parallel_layouts_match_single_process(parity, case):
    ref = _losses(parity / case / "ref.json")["losses"]
    assert ref[0] > 0 and ref[0] != ref[1]
    for name in CASES[case][1]:
        # DP=2 halves the micro-batches per rank: 1 micro-batch of 2 on each of 2 ranks
        out = _losses(parity / case / f"{name}.json")
        assert out["losses"] == pytest.approx(ref, rel=1e-5, abs=1e-6), (name, out["losses"], ref)
        assert out["replica_spread"] < 1e-6, name  # TP replicas did not drift apart


@pytest.mark.slow
def test_bf16_training_tracks_fp32(parity):
    fp32 = _losses(parity / "bf16" / "fp32.json")["losses"]
    for backend in BF16_BACKENDS:
        bf16 = _losses(parity / "bf16" / f"{backend}.json")["losses"]
        assert bf16 == pytest.approx(fp32, rel=2e-2) and bf16 != fp32, backend
