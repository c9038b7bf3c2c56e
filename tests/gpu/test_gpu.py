"""The GPU path: the device rule of the forward step, the `torch` backend (SDPA / FlexAttention core attention)
against megatron's local spec, backend choice, and the one-shot GPU check's dry run.

Tests marked `gpu` need CUDA and are skipped without it; `benchmarks/gpu_check.py` runs them on a GPU. The rest
runs on the CPU, where the torch spec runs too (SDPA; dense masks instead of FlexAttention, which has no CPU
backward)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import tiny_config

ROOT = Path(__file__).resolve().parents[2]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (mode, overrides): bidirectional and causal, grouped-query attention with qk norms, adaLN time conditioning,
# packed documents both ways
# (ids: gpu_check runs the `documents` cases, FlexAttention compiles on CUDA, after everything else)
CASES = [
    pytest.param("difflm-noshift", [], id="bidirectional"),
    pytest.param("ar", [], id="causal"),
    pytest.param("difflm-noshift", ["model.num_query_groups=1", "model.qk_layernorm=true"], id="mqa-qknorm"),
    pytest.param("difflm-noshift", ["diffusion.time_embedding=true"], id="time"),
    pytest.param("difflm-noshift", ["model.document_attention=true", "model.num_query_groups=1"], id="documents-mqa"),
    pytest.param("ar", ["model.document_attention=true"], id="documents-causal"),
]


def _pair(tmp_path, mode: str, over: list[str], device: str, dtype=torch.float32):
    """The same weights in the local spec and the torch spec."""
    from models.megatron.gpt import build_model

    cfgs = [
        tiny_config(tmp_path, f"diffusion.model_running_mode={mode}", f"model.backend={b}", *over)
        for b in ("local", "torch")
    ]
    torch.manual_seed(0)
    local = build_model(cfgs[0], 512).to(device=device, dtype=dtype).eval()
    torched = build_model(cfgs[1], 512).to(device=device, dtype=dtype).eval()
    assert set(local.state_dict()) == set(torched.state_dict())  # checkpoints are interchangeable
    torched.load_state_dict(local.state_dict())
    return cfgs[1], local, torched


def _inputs(cfg, device: str):
    from models import diffusion
    from models.megatron.attention import DocumentMask

    g = torch.Generator().manual_seed(1)
    x = torch.randint(3, 500, (2, 24), generator=g)
    x[:, 9] = 0  # an EOS: two packed documents per row
    x, pos = x.to(device), torch.arange(24, device=device)[None].expand(2, -1)
    kw = {"t": torch.rand(2, generator=g).to(device)} if cfg.diffusion.time_embedding else {}
    if not cfg.model.document_attention:
        return x, pos, None, None, kw
    causal = cfg.diffusion.model_running_mode == "ar"
    doc = diffusion.document_ids(x, 0)
    return x, pos, diffusion.document_attention_mask(doc, causal), DocumentMask(doc, causal), kw


def _compare(tmp_path, mode, over, device: str, dtype, atol: float) -> None:
    cfg, local, torched = _pair(tmp_path, mode, over, device, dtype)
    x, pos, dense, doc_mask, kw = _inputs(cfg, device)
    with torch.no_grad():
        want = local(x, pos, dense, **kw).float()
        got = torched(x, pos, doc_mask, **kw).float()
    assert type(torched.decoder.layers[0].self_attention.core_attention).__name__ == "TorchCoreAttention"
    assert (got - want).abs().max().item() < atol


@pytest.mark.parametrize("mode, over", CASES)
def test_torch_spec_gives_the_local_spec_logits(megatron_single_process, tmp_path, mode, over):
    _compare(tmp_path, mode, over, "cpu", torch.float32, 1e-5)  # measured ~1e-7


def test_torch_spec_trains_with_documents_on_the_cpu(megatron_single_process, tmp_path):
    """Gradients flow through the torch spec's packed-document path (dense mask to SDPA on the CPU)."""
    cfg, local, torched = _pair(tmp_path, "difflm-noshift", ["model.document_attention=true"], "cpu")
    x, pos, dense, doc_mask, _ = _inputs(cfg, "cpu")
    local(x, pos, dense).float().square().mean().backward()
    torched(x, pos, doc_mask).float().square().mean().backward()
    for (name, a), b in zip(local.named_parameters(), torched.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


class _Recorder(torch.nn.Module):
    """Stands in for the model: one parameter on `device`, records where each input tensor lives."""

    def __init__(self, device: str):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, device=device))
        self.devices: dict = {}

    def forward(self, input_ids, position_ids, attention_mask, labels=None, **kwargs):
        from models.megatron.attention import DocumentMask

        mask = attention_mask.doc_ids if isinstance(attention_mask, DocumentMask) else attention_mask
        packed = kwargs.pop("packed_seq_params", None)
        if packed is not None:  # THD: the boundaries are tensors too
            kwargs["cu_seqlens"] = packed.cu_seqlens_q
        self.shapes = {"input_ids": input_ids.shape, "labels": None if labels is None else labels.shape}
        for name, value in {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "attention_mask": mask,
            "labels": labels,
            **kwargs,
        }.items():
            if value is not None:
                self.devices[name] = value.device
        return torch.zeros(input_ids.shape, device=self.weight.device)


@pytest.mark.parametrize("backend", ["local", "torch"])
@pytest.mark.parametrize("mode", ["difflm-noshift", "ar", "difflm-noshift-uniform"])
def test_forward_step_inputs_land_on_the_model_device(tmp_path, mode, backend):
    """The device rule: batches and noise are made on the CPU; the step moves every tensor to the model's
    device. The meta device stands in for a GPU here (a CPU tensor left behind stays on 'cpu')."""
    from models.megatron.forward_step import SpecialTokens, make_forward_step

    cfg = tiny_config(
        tmp_path,
        f"diffusion.model_running_mode={mode}",
        f"model.backend={backend}",
        "model.document_attention=true",
        "diffusion.time_embedding=true",
    )
    special = SpecialTokens(mask_id=1, vocab_size=512, special_ids=(0, 1, 2), eos_id=0, pad_id=2)
    x = torch.randint(3, 500, (4, 32))
    batch = {
        "tokens": x,
        "labels": torch.roll(x, -1, 1),
        "loss_mask": torch.ones_like(x, dtype=torch.float),
        "positions": torch.arange(4),
    }
    model = _Recorder("meta")
    output, loss_func = make_forward_step(cfg, special, step=3)(iter([batch]), model)
    expected = (
        {"input_ids", "position_ids", "attention_mask"}
        | ({"t"} if mode != "ar" else set())
        | ({"labels"} if mode != "difflm-noshift-uniform" else set())
    )
    assert set(model.devices) == expected
    assert all(d.type == "meta" for d in model.devices.values()), model.devices
    assert loss_func.args[0]["scored"].device.type == "meta"  # what the loss reads is there too


def test_backend_choice(monkeypatch):
    from models.megatron import backend

    assert backend.resolve_backend("torch") == "torch"
    assert backend.resolve_backend("local") == "local"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # the torch spec gives the local spec's logits (test_torch_spec_gives_the_local_spec_logits) and trains
    # faster on the CPU too: it is the default everywhere without Transformer Engine
    assert backend.resolve_backend("auto") == "torch"
    assert backend.resolve_backend("auto", two_stream=True) == "torch"
    with pytest.raises(RuntimeError, match="model.backend=torch"):
        backend.resolve_backend("te")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backend, "transformer_engine_available", lambda: False)
    assert backend.resolve_backend("auto") == "torch"  # a GPU without Transformer Engine


ABSENT_ON_THE_GPU_IMAGE = ("prefect", "mlflow", "datatrove", "lm_eval", "data_prep", "flows", "tasks")
# on the GPU image these come from benchmarks/gpu_wheels/ (installed by the check into a target folder)
FROM_THE_WHEELS = ("megatron", "pydantic", "pydantic_core", "annotated_types", "typing_inspection")
SECTIONS = (
    "environment",
    "probe",
    "data",
    "microbatch-1b",
    "train-difflm",
    "export",
    "spec-parity",
    "gpu-tests",
    "train-ar",
    "gpu-tests-flex",
)


def _gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _image_env(tmp_path, hide_wheel_packages: bool) -> dict:
    """An environment built like the GPU image, in every process the check starts (sitecustomize runs at each
    interpreter's start): the orchestration stack blocked, and (hide_wheel_packages) megatron-core / pydantic
    invisible in this venv, so that only a copy the check installs from the wheels can be imported."""
    absent = tmp_path / "absent"
    absent.mkdir()
    hidden = FROM_THE_WHEELS if hide_wheel_packages else ()
    (absent / "sitecustomize.py").write_text(
        f"""import importlib.machinery, sys, sysconfig
for name in {ABSENT_ON_THE_GPU_IMAGE!r}:
    sys.modules[name] = None
HIDDEN = {hidden!r}
VENV = {{sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}}


class HideVenvCopies:
    # top-level HIDDEN packages are looked up everywhere but this venv's site-packages
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in HIDDEN:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, [p for p in sys.path if p not in VENV])
        if spec is None:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return spec


sys.meta_path.insert(0, HideVenvCopies)
"""
    )
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(absent), os.environ.get("PYTHONPATH", "")])}


def _lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_gpu_check_dry_run_in_an_environment_built_like_the_gpu_image(tmp_path):
    """The rehearsal: `benchmarks/gpu_check.py --dry-run` where megatron-core and pydantic are absent and come
    from a wheels folder (installed into a target folder, as on the GPU machine; here this venv's copies
    repacked) and prefect / mlflow / datatrove / lm_eval cannot be imported. Every section runs, in the GPU
    order, each with its JSON line on stdout. (The check once died here on find_spec.)"""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_wheels
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in gpu_wheels.PACKAGES:
        gpu_wheels.repack_installed(name, wheels)
    env = _image_env(tmp_path, hide_wheel_packages=True)
    probe = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; u.find_spec('megatron.core')"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert "No module named 'megatron'" in probe.stderr  # the environment hides this venv's megatron
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), str(out), "--dry-run", "--wheels", str(wheels)],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    sections = report["sections"]
    assert list(sections) == list(SECTIONS)
    assert {n: s["status"] for n, s in sections.items()} == {n: "ok" for n in SECTIONS}, proc.stdout[-4000:]
    lines = _lines(proc.stdout)
    assert [x["section"] for x in lines if "status" in x] == list(SECTIONS)  # one line per section, in order
    assert lines[-1]["failed"] == []
    environment = report["environment"]
    assert environment["installed_from_wheels"] == ["megatron-core", "pydantic"]
    assert environment["megatron_core"] == "0.16.1" and str(out / ".site") in environment["megatron_path"]
    assert environment["env"]["HF_HUB_OFFLINE"] == "1"
    probe = sections["probe"]["result"]
    assert probe["collectives"]["gloo"]["ok"] and probe["ceilings"]["matmul"]["ms"] > 0
    assert all(r["chosen"] and r["default_ms"] > 0 for r in probe["attention"].values())
    for mode in ("difflm", "ar"):
        trained = sections[f"train-{mode}"]["result"]
        assert trained["tokens_per_s_per_device"] > 0 and trained["tflops_per_device"] > 0
        assert trained["mfu"] is None  # no peak figure for a CPU: no made-up MFU
    parity = sections["spec-parity"]["result"]
    assert parity["fp32_rel_diff"] < 1e-5 and parity["bf16_rel_diff"] < 5e-2
    exported = sections["export"]["result"]
    assert exported["fp32_parity_ok"] and exported["fp32"]["max_abs_diff"] < 1e-3
    assert exported["bf16_parity_ok"], exported["bf16"]
    assert exported["masked_tokens"] > 0
    micro = sections["microbatch-1b"]["result"]
    assert micro["largest_micro_batch"] == 2 and micro["difflm_over_ar_tflops"] > 0
    assert [(r["mode"], r["micro_batch"]) for r in micro["rows"]] == [
        ("difflm-noshift", 1),
        ("difflm-noshift", 2),
        ("ar", 2),
    ]
    shares = micro["profile"]["share"]
    assert shares["gemm"] > 0 and abs(sum(shares.values()) - 1) < 0.01
    assert micro["profile"]["optimizer_ms"] > 0
    for name in ("gpu-tests", "gpu-tests-flex"):  # the flex tests apart, last (on the CPU: skipped, no CUDA)
        assert "skipped" in sections[name]["result"]["summary"] and "deselected" in sections[name]["result"]["summary"]
    md = (out / "report.md").read_text()
    assert "| train-difflm | ok |" in md and "Profiled step" in md


def _kill_leftovers(marker: str) -> None:
    """This test's own processes (their command lines name its folder) that outlived the check."""
    import psutil

    mine = [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    for p in mine:
        p.kill()
    psutil.wait_procs(mine, timeout=10)


@pytest.mark.slow
def test_gpu_check_killed_mid_run_keeps_the_finished_sections(tmp_path):
    """A check killed (SIGKILL, no chance to clean up) during its fifth section: report.json / report.md hold
    the figures of every section that finished, the sweep's rows were in the report while it ran, and the
    section in flight says 'running'."""
    import signal

    out = tmp_path / "report"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), str(out), "--dry-run"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=tmp_path,
        env=_image_env(tmp_path, hide_wheel_packages=False),
        start_new_session=True,
    )
    seen_rows_in_report = False
    try:
        for line in proc.stdout:
            msg = json.loads(line)
            if msg.get("section") == "microbatch-1b" and "row" in msg and not seen_rows_in_report:
                partial = json.loads((out / "report.json").read_text())["sections"]["microbatch-1b"]
                assert partial["status"] == "running" and partial["partial"]["rows"]
                seen_rows_in_report = True
            if msg.get("section") == "microbatch-1b" and "status" in msg:
                time.sleep(1.0)  # train-difflm starts
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        _kill_leftovers(str(out))  # torchrun's worker runs in a session of its own: SIGKILL orphans it
    assert seen_rows_in_report
    sections = json.loads((out / "report.json").read_text())["sections"]
    assert {n: sections[n]["status"] for n in SECTIONS[:4]} == {n: "ok" for n in SECTIONS[:4]}
    assert sections["train-difflm"]["status"] == "running"
    assert sections["microbatch-1b"]["result"]["rows"][0]["tokens_per_s"] > 0
    assert sections["probe"]["result"]["ceilings"]["matmul"]["ms"] > 0
    md = (out / "report.md").read_text()
    assert "| microbatch-1b | ok |" in md and "| train-difflm | running |" in md
    assert "Largest micro-batch: 2" in md


def test_gpu_check_environment_guards(monkeypatch):
    """find_spec of a submodule whose parent is absent raises (it does not return None): guarded; a
    typing-extensions too old for pydantic counts as missing; the wheel set carries it and psutil."""
    import importlib.metadata

    check = _gpu_check()
    assert check.present("json") and not check.present("no_such_package_xyz.core")
    assert check.missing_packages() == []
    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "4.12.2" if name == "typing-extensions" else real(name)
    )
    assert check.missing_packages() == ["typing-extensions"]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_wheels
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert {"megatron-core", "pydantic", "pydantic-core", "typing-extensions", "psutil"} <= set(gpu_wheels.PACKAGES)


def test_gpu_check_section_statuses_reach_the_report_at_once(tmp_path, capsys):
    """ok / failed / timeout (a child out of time) / skipped (budget), each in report.json and report.md as soon
    as the section ends, with one JSON line on stdout."""
    check = _gpu_check()
    run = check.Check(tmp_path, check.plan(True), 100.0, {"dry_run": True})

    def timed_out():
        raise subprocess.TimeoutExpired(["torchrun"], 5)

    run.section("a", lambda: {"x": 1})
    assert json.loads((tmp_path / "report.json").read_text())["sections"]["a"]["status"] == "ok"
    run.section("b", timed_out)
    run.section("c", lambda: 1 / 0)
    run.section("d", lambda: {}, need_s=1e9)
    sections = json.loads((tmp_path / "report.json").read_text())["sections"]
    assert [s["status"].split(":")[0] for s in sections.values()] == ["ok", "timeout", "failed", "skipped"]
    assert "ZeroDivisionError" in sections["c"]["error"]
    assert "| b | timeout |" in (tmp_path / "report.md").read_text()
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["section"], x["status"]) for x in lines] == [
        ("a", "ok"),
        ("b", "timeout"),
        ("c", "failed"),
        ("d", "skipped"),
    ]


def test_gpu_check_only_runs_the_named_sections_and_refuses_unknown_names(tmp_path):
    """--only (a second device call for what the first ran out of time for): environment and data always run;
    a misspelt name is an argument error listing the sections."""
    check = _gpu_check()
    assert check._sections("gpu-tests-flex, train-ar") == {"gpu-tests-flex", "train-ar"}
    with pytest.raises(Exception, match="unknown section.*flex.*choose from environment"):
        check._sections("flex")
    run = check.Check(tmp_path, check.plan(True), 100.0, {"dry_run": True}, only={"gpu-tests-flex"})
    ran = [n for n in ("environment", "data", "probe", "gpu-tests-flex") if run.section(n, lambda: {"x": 1})]
    assert ran == ["environment", "data", "gpu-tests-flex"]
    assert run.sections["probe"]["status"] == "skipped: not in --only"


def test_gpu_check_installs_wheels_without_pip(tmp_path, monkeypatch):
    """An image without pip: the wheels are unpacked into the target folder."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_wheels
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    check = _gpu_check()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    gpu_wheels.repack_installed("typing-extensions", wheels)
    monkeypatch.setattr(check, "has_pip", lambda: False)
    check.install_wheels(wheels, tmp_path / "site")
    assert (tmp_path / "site" / "typing_extensions.py").exists()
    assert list((tmp_path / "site").glob("typing_extensions-*.dist-info/METADATA"))


def test_gpu_check_row_errors_and_kernel_categories():
    check = _gpu_check()
    assert check.memory_error(torch.OutOfMemoryError("CUDA out of memory"))
    assert check.memory_error(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not check.memory_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert check.kernel_category("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert check.kernel_category("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN") == "gemm"
    assert check.kernel_category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert check.kernel_category("fmha_cutlassF_bf16_aligned_64x128_rf_sm80") == "attention"
    assert check.kernel_category("void at::native::multi_tensor_apply_kernel<FusedAdam>") == "optimizer"
    assert check.kernel_category("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "communication"
    assert check.kernel_category("void at::native::vectorized_elementwise_kernel<4, silu>") == "elementwise"
    # a sweep cut short: the figures of the rows it has
    rows = [
        {"mode": "difflm-noshift", "micro_batch": 8, "step_s": 1.0, "tflops": 300.0, "mfu": 0.3, "tokens_per_s": 1},
        {"mode": "difflm-noshift", "micro_batch": 12, "oom": False, "error": "RuntimeError: CUDA error: misaligned"},
    ]
    summary = check.microbatch_summary({"big": "1b", "big_seq": 2048}, rows)
    assert summary["largest_micro_batch"] == 8 and summary["mfu"] == 0.3 and summary["ar_mfu"] is None


# ---- packed documents as THD sequences (Transformer Engine's form), tested on the torch spec -----------------
def _special():
    from models.megatron.forward_step import SpecialTokens

    return SpecialTokens(mask_id=1, vocab_size=512, special_ids=(0, 1, 2), eos_id=0, pad_id=2)


def _packed_batch() -> dict:
    """Three rows of 24 with every document shape: EOS inside and as the last token, a row without EOS, an
    EOS first (a one-token document)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(3, 500, (3, 24), generator=g)
    x[0, 9] = x[0, 23] = 0
    x[2, 0] = x[2, 15] = 0
    return {
        "tokens": x,
        "labels": torch.roll(x, -1, 1),
        "loss_mask": torch.ones_like(x, dtype=torch.float),
        "positions": torch.arange(3),
    }


def test_packed_documents_cu_seqlens():
    from models import diffusion
    from models.megatron.forward_step import packed_documents

    x = torch.tensor(
        [
            [5, 5, 0, 6, 6, 6],  # EOS inside: [5 5 EOS] [6 6 6]
            [7, 7, 7, 7, 7, 7],  # no EOS: the row is one sequence
            [8, 0, 9, 9, 9, 0],  # EOS as the last token ends its document, nothing empty follows
            [0, 4, 4, 0, 0, 4],
        ]
    )  # EOS first, two EOS in a row: one-token documents
    cu, longest = packed_documents(diffusion.document_ids(x, 0))
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, 3, 6, 12, 14, 18, 19, 22, 23, 24]
    assert longest == 6
    cu, longest = packed_documents(diffusion.document_ids(torch.full((1, 7), 3), 0))
    assert cu.tolist() == [0, 7] and longest == 7  # one row, no EOS: one sequence
    cu, _ = packed_documents(diffusion.document_ids(torch.tensor([[3, 0], [0, 3]]), 0))
    assert cu.tolist() == [0, 2, 3, 4]  # a document never crosses a row boundary


def test_document_form_per_backend(tmp_path):
    from megatron.core.transformer.enums import AttnMaskType

    from models.megatron.forward_step import document_form
    from models.megatron.gpt import layer_spec

    assert document_form("te") == "thd"
    assert document_form("torch") == "flex"
    assert document_form("local") == "dense"
    assert document_form("te", pipeline_parallel=2, micro_batch_size=1) == "thd"  # p2p [s, 1, h] = [b*s, 1, h]
    assert document_form("te", pipeline_parallel=2, micro_batch_size=2) == "dense"  # p2p shapes [s, b, h]
    model = tiny_config(tmp_path, "model.document_attention=true").model

    def mask(backend, bidirectional, documents=None):
        return layer_spec(model, bidirectional, backend, documents=documents).submodules.self_attention.params[
            "attn_mask_type"
        ]

    assert mask("local", True) == AttnMaskType.arbitrary  # the dense [b, 1, s, s] mask
    assert mask("torch", True, "dense") == AttnMaskType.arbitrary
    # DocumentMask / THD carry the documents; the spec carries the direction (TE: padding / padding_causal)
    assert mask("torch", True) == mask("torch", True, "thd") == AttnMaskType.no_mask
    assert mask("torch", False, "thd") == AttnMaskType.causal


TIME_INPUT = ["diffusion.time_embedding=true", "diffusion.time_conditioning=input"]
THD_CASES = [
    ("difflm-noshift", []),
    ("difflm-noshift", TIME_INPUT),
    ("ar", []),
    ("ar", TIME_INPUT),
    ("difflm-noshift-uniform", TIME_INPUT),
]  # uniform: the step gets logits [1, b*s, V], not CE


def _document_models(tmp_path, mode: str, over: list[str], device: str = "cpu", dtype=torch.float32):
    """The local and torch specs with document attention on the same weights, the time embedding randomised
    (it starts at zero, which would hide a wrong per-token expansion)."""
    cfg, local, torched = _pair(tmp_path, mode, ["model.document_attention=true", *over], device, dtype)
    if local.time_embedding is not None:
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in local.time_embedding.parameters():
                p.copy_(torch.randn(p.shape, generator=g).to(p) * 0.5)
        torched.load_state_dict(local.state_dict())
    return cfg, local, torched


def _step_outputs(cfg, model, documents: str, batch: dict, grad: bool = False):
    """(raw output, [b, s(, V)] output, loss sum) of the forward step with packed documents in `documents` form."""
    from models.megatron.forward_step import make_forward_step

    with torch.set_grad_enabled(grad):
        out, loss_func = make_forward_step(cfg, _special(), step=2, documents=documents)(iter([batch]), model)
        total, count, _ = loss_func(out)
    b, s = batch["tokens"].shape
    return out, out.reshape(b, s, *out.shape[2:]), total, count


@pytest.mark.parametrize("mode, over", THD_CASES)
def test_thd_packed_sequences_give_the_document_mask_losses(megatron_single_process, tmp_path, mode, over):
    """Transformer Engine's form (one row [1, b*s], one sequence per document, RoPE restarted per sequence)
    gives the per-token loss / logits of the DocumentMask path and of the local spec's dense mask."""
    cfg, local, torched = _document_models(tmp_path, mode, over)
    batch = _packed_batch()
    _, dense, dense_total, count = _step_outputs(cfg, local, "dense", batch)
    _, flex, flex_total, _ = _step_outputs(cfg, torched, "flex", batch)
    raw, thd, thd_total, thd_count = _step_outputs(cfg, torched, "thd", batch)
    assert raw.shape[:2] == (1, 72)  # megatron's output under THD: one row
    assert (flex - dense).abs().max().item() < 1e-5
    assert (thd - dense).abs().max().item() < 1e-5
    assert (thd - flex).abs().max().item() < 1e-5
    assert abs(thd_total.item() - dense_total.item()) < 1e-4 * abs(dense_total.item()) and thd_count == count
    assert abs(flex_total.item() - dense_total.item()) < 1e-4 * abs(dense_total.item())


@pytest.mark.parametrize("mode", ["difflm-noshift", "ar"])
def test_thd_logits_equal_the_dense_mask_logits(megatron_single_process, tmp_path, mode):
    """The model itself: logits [1, b*s, V] under THD, reshaped, are the local spec's with the dense mask."""
    from models import diffusion
    from models.megatron.forward_step import packed_seq_params

    over = TIME_INPUT if mode != "ar" else []
    cfg, local, torched = _document_models(tmp_path, mode, over)
    x = _packed_batch()["tokens"]
    b, s = x.shape
    doc = diffusion.document_ids(x, 0)
    pos = torch.arange(s)[None].expand(b, -1)
    kw = {"t": torch.tensor([0.2, 0.5, 0.9])} if over else {}
    with torch.no_grad():
        want = local(x, pos, diffusion.document_attention_mask(doc, causal=mode == "ar"), **kw)
        got = torched(
            x.reshape(1, -1),
            pos.reshape(1, -1),
            None,
            packed_seq_params=packed_seq_params(doc, torch.device("cpu")),
            **kw,
        )
    assert got.shape == (1, b * s, want.shape[-1])
    assert (got.reshape(want.shape) - want).abs().max().item() < 1e-5


def test_thd_gradients_equal_the_dense_mask_gradients(megatron_single_process, tmp_path):
    """Backward through THD (per-document RoPE, the per-row time embedding) gives the dense path's gradients."""
    cfg, local, torched = _document_models(tmp_path, "difflm-noshift", TIME_INPUT)
    batch = _packed_batch()
    _, _, dense_total, _ = _step_outputs(cfg, local, "dense", batch, grad=True)
    _, _, thd_total, _ = _step_outputs(cfg, torched, "thd", batch, grad=True)
    dense_total.backward()
    thd_total.backward()
    for (name, a), b in zip(local.named_parameters(), torched.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), name
    assert torched.time_embedding.linear_2.weight.grad.abs().sum() > 0


def test_thd_forward_step_flattens_rows_onto_the_model_device(tmp_path):
    """The THD step hands the model one row [1, b*s], no mask, int32 boundaries and t [b], all on its device."""
    from models.megatron.forward_step import make_forward_step

    cfg = tiny_config(tmp_path, "model.backend=torch", "model.document_attention=true", *TIME_INPUT)
    batch = _packed_batch()
    model = _Recorder("meta")
    output, loss_func = make_forward_step(cfg, _special(), step=3, documents="thd")(iter([batch]), model)
    assert set(model.devices) == {"input_ids", "position_ids", "labels", "t", "cu_seqlens"}
    assert all(d.type == "meta" for d in model.devices.values()), model.devices
    assert model.shapes == {"input_ids": (1, 72), "labels": (1, 72)}
    assert output.shape == (1, 72)


# ---- on a GPU ---------------------------------------------------------------------------------------------
@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("mode, over", CASES)
def test_cuda_torch_spec_gives_the_local_spec_logits(megatron_single_process, tmp_path, mode, over):
    """fp32: SDPA / FlexAttention against megatron's unfused softmax; bf16: within bf16 rounding."""
    torch.backends.cuda.matmul.allow_tf32 = False
    _compare(tmp_path, mode, over, "cuda", torch.float32, 1e-4)
    _compare(tmp_path, mode, over, "cuda", torch.bfloat16, 0.15)


@cuda
@pytest.mark.gpu
def test_cuda_flex_attention_document_mask_matches_dense_with_gradients():
    from models import diffusion
    from models.megatron.attention import DocumentMask, _flex_attention

    g = torch.Generator().manual_seed(0)
    x = torch.randint(3, 500, (2, 256), generator=g)
    x[:, [40, 130, 200]] = 0
    doc = diffusion.document_ids(x, 0).cuda()
    for causal in (False, True):
        mask = DocumentMask(doc, causal)
        q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", requires_grad=True) for _ in range(3))
        got = _flex_attention()(q, k, v, block_mask=mask.block_mask())
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense_keep())
        assert (got - want).abs().max().item() < 1e-4
        grads = torch.autograd.grad(got.sum(), (q, k, v))
        ref = torch.autograd.grad(want.sum(), (q, k, v))
        assert all((a - b).abs().max().item() < 1e-3 for a, b in zip(grads, ref))


@cuda
@pytest.mark.gpu
def test_cuda_forward_step_runs_on_the_gpu(megatron_single_process, tmp_path):
    """A real megatron model on the GPU takes the step's batch (made on the CPU) without a device error."""
    from models.megatron.forward_step import SpecialTokens, make_forward_step
    from models.megatron.gpt import build_model

    cfg = tiny_config(tmp_path, "model.backend=torch", "diffusion.time_embedding=true")
    model = build_model(cfg, 512).cuda()
    special = SpecialTokens(mask_id=1, vocab_size=512, special_ids=(0, 1, 2), eos_id=0, pad_id=2)
    x = torch.randint(3, 500, (4, 32))
    batch = {
        "tokens": x,
        "labels": torch.roll(x, -1, 1),
        "loss_mask": torch.ones_like(x, dtype=torch.float),
        "positions": torch.arange(4),
    }
    output, loss_func = make_forward_step(cfg, special, step=0)(iter([batch]), model)
    total, count, _ = loss_func(output)
    assert output.is_cuda and torch.isfinite(total) and count > 0


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["difflm-noshift", "ar"])
def test_cuda_thd_on_the_torch_spec_gives_the_dense_mask_losses(megatron_single_process, tmp_path, mode):
    """On CUDA the THD sequences become a FlexAttention block mask; fp32 losses within 1e-4 of the dense path."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg, local, torched = _document_models(tmp_path, mode, TIME_INPUT if mode != "ar" else [], "cuda")
    batch = _packed_batch()
    _, dense, _, _ = _step_outputs(cfg, local, "dense", batch)
    _, thd, _, _ = _step_outputs(cfg, torched, "thd", batch)
    assert (thd - dense).abs().max().item() < 1e-4


def _te_available() -> bool:
    from models.megatron.backend import transformer_engine_available

    return torch.cuda.is_available() and transformer_engine_available()


te = pytest.mark.skipif(not _te_available(), reason="needs CUDA and Transformer Engine")


@te
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["difflm-noshift", "ar"])
def test_cuda_te_thd_keeps_documents_apart(megatron_single_process, tmp_path, mode):
    """Transformer Engine's THD path: each document's output equals the document run alone (RoPE is relative),
    and the step's loss is finite. bf16: TE's fused kernels take half precision."""
    from models import diffusion
    from models.megatron.forward_step import packed_seq_params
    from models.megatron.gpt import build_model

    cfg = tiny_config(
        tmp_path,
        f"diffusion.model_running_mode={mode}",
        "model.backend=te",
        "model.document_attention=true",
        "train.precision=bf16",
    )
    model = build_model(cfg, 512).cuda().eval()
    batch = _packed_batch()
    x = batch["tokens"].cuda()
    b, s = x.shape
    with torch.no_grad():
        packed = model(
            x.reshape(1, -1),
            torch.arange(s, device="cuda").repeat(b)[None],
            None,
            packed_seq_params=packed_seq_params(diffusion.document_ids(batch["tokens"], 0), x.device),
        )
        packed = packed.reshape(b, s, -1).float()
        for row, (start, end) in [(0, (0, 10)), (0, (10, 24)), (1, (0, 24)), (2, (1, 16))]:
            alone = model(x[row : row + 1, start:end], torch.arange(end - start, device="cuda")[None], None).float()
            assert (packed[row, start:end] - alone[0]).abs().max().item() < 0.15, (row, start, end)
    _, _, total, count = _step_outputs(cfg, model, "thd", batch)
    assert torch.isfinite(total) and count > 0
