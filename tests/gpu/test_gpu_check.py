"""The one-shot GPU check (benchmarks/gpu_check.py and benchmarks/gpu/): its dry run in an environment built like
the GPU image, a kill mid-run, the offline installs, the report's statuses, --only, and the figures of the
micro-batch harness (pure functions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check as check
from benchmarks import gpu_wheels
from benchmarks.gpu import corpus, figures, runtime
from benchmarks.gpu.plan import plan
from benchmarks.gpu.report import Check

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = check.NAMES  # the check's own table: a new section is rehearsed here without another list to edit

# the rehearsal's installed wheels, kept between sessions (by the digest of the wheels: runtime.cached_site)
SITE_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "difflm" / "gpu-rehearsal-site"
ABSENT_ON_THE_GPU_IMAGE = ("prefect", "mlflow", "datatrove", "lm_eval", "data_prep", "flows", "tasks")
# on the GPU image these come from benchmarks/gpu_wheels/ (installed by the check into a target folder)
FROM_THE_WHEELS = ("megatron", "pydantic", "pydantic_core", "annotated_types", "typing_inspection")


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


@pytest.mark.slow(reason="every section of the GPU check, most in a child process of its own")
@pytest.mark.timeout(1800)  # 15 sections, most in a child process of their own: about 12 minutes on 2 idle cores
def test_gpu_check_dry_run_in_an_environment_built_like_the_gpu_image(tmp_path):
    """The rehearsal: `benchmarks/gpu_check.py --dry-run` where megatron-core and pydantic are absent and come
    from a wheels folder (installed into a target folder, as on the GPU machine; here this venv's copies
    repacked) and prefect / mlflow / datatrove / lm_eval cannot be imported. Every section runs, in the GPU
    order, each with its JSON line on stdout. (The check once died here on find_spec.)"""
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
    # the installed wheels are cached by their digest (as the Docker test caches its images): installed once,
    # then reused by every later rehearsal with the same wheels (test_the_site_cache_... checks the cache itself)
    argv = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), str(out), "--dry-run", "--wheels", str(wheels)]
    proc = subprocess.run(
        [*argv, "--site-cache", str(SITE_CACHE)],
        capture_output=True,
        text=True,
        timeout=1800,
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
    site = SITE_CACHE / runtime.wheels_digest(wheels)
    assert environment["megatron_core"] == "0.16.1" and str(site) in environment["megatron_path"]
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
    assert micro["largest_micro_batch"] == 2 and micro["over_baseline_tflops"] > 0
    assert [(r["mode"], r["micro_batch"], r.get("repeat")) for r in micro["rows"]] == [
        ("difflm-noshift", 1, None),
        ("difflm-noshift", 2, None),
        ("difflm-noshift", 2, True),  # the headline row once more: the run-to-run spread
        ("ar", 2, None),
    ]
    assert all(r["timed_steps"] == 2 and r["step_min_s"] <= r["step_s"] <= r["step_max_s"] for r in micro["rows"])
    assert micro["repeat_mfu"] is None and micro["mfu_without_optimizer"] is None  # no MFU on a CPU
    (prof,) = micro["profiles"]
    assert prof["share"]["gemm"] > 0 and abs(sum(prof["share"].values()) - 1) < 0.01
    assert prof["optimizer_ms"] > 0 and prof["unprofiled_step_ms"] > 0 and prof["top_elementwise"]
    # long context with document masks: both modes at both lengths, the attention counted from the real documents
    long = sections["long-context"]["result"]
    assert [(r["mode"], r["seq"]) for r in long["rows"]] == [
        ("difflm-noshift", 128),
        ("difflm-noshift", 256),
        ("ar", 128),
        ("ar", 256),
    ]
    assert all(0 < r["pairs_share"] < 0.5 for r in long["rows"]), long["rows"]  # documents of 8-64 tokens
    assert [p["micro_batch"] for p in sections["profile-350m"]["result"]["profiles"]] == [1, 2]
    block = sections["train-block"]["result"]
    assert block["block"]["mode"] == "difflm-block" and block["complementary"]["complementary_masks"]
    assert all(r["tokens_per_s_per_device"] > 0 and r["tflops_per_device"] > 0 for r in block.values())
    _assert_decoded(sections["decode"]["result"])
    for name in ("gpu-tests", "gpu-tests-flex"):  # the flex tests apart, last (on the CPU: skipped, no CUDA)
        assert "skipped" in sections[name]["result"]["summary"] and "deselected" in sections[name]["result"]["summary"]
    md = (out / "report.md").read_text()
    assert "| train-difflm | ok |" in md and "Profiled step" in md and "| long-context | ok |" in md


def _assert_decoded(decoded: dict) -> None:
    """The decode section's dry run: three confident models trained and exported; every mode of both model kinds
    at both batch sizes; the goal judged at each."""
    modes = ("difflm-noshift", "difflm-block", "ar")
    assert not decoded["errors"] and set(decoded["trained"]) == set(modes)
    kinds = {(r["model"], r["mode"], r["batch_size"]) for r in decoded["rows"]}
    assert kinds == {(k, m, b) for k in ("tiny-shaped, random", "confident (tiny)") for m in modes for b in (1, 4)}
    assert all(r["tokens_per_s"] > 0 and r["model_calls_per_token"] > 0 for r in decoded["rows"])
    assert set(decoded["goal"]) == {"batch 1", "batch 4"}
    # the same evaluation record as `difflm eval` writes: one per model and batch size, the decoders as its sweep
    from difflm.models.evaluation.record import EvalRecord

    records = [EvalRecord.read(p) for p in decoded["records"]]
    assert len(records) == len(kinds) and all(r.tpf and r.nfe and r.sweep and r.environment for r in records)


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
    assert "Headline: seq 64, micro-batch 2: MFU" in md


def test_gpu_check_environment_guards(monkeypatch):
    """find_spec of a submodule whose parent is absent raises (it does not return None): guarded; a
    typing-extensions too old for pydantic counts as missing; the wheel set carries it and psutil."""
    assert runtime.present("json") and not runtime.present("no_such_package_xyz.core")
    assert runtime.missing_packages() == []
    real = runtime.version
    monkeypatch.setattr(runtime, "version", lambda name: "4.12.2" if name == "typing-extensions" else real(name))
    assert runtime.missing_packages() == ["typing-extensions"]
    assert {"megatron-core", "pydantic", "pydantic-core", "typing-extensions", "psutil"} <= set(gpu_wheels.PACKAGES)


def test_gpu_check_section_statuses_reach_the_report_at_once(tmp_path, capsys):
    """ok / failed / timeout (a child out of time) / skipped (budget), each in report.json and report.md as soon
    as the section ends, with one JSON line on stdout."""
    run = Check(tmp_path, plan(True), 100.0, {"dry_run": True})

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
    assert check._sections("gpu-tests-flex, train-ar") == {"gpu-tests-flex", "train-ar"}
    with pytest.raises(Exception, match="unknown section.*flex.*choose from environment"):
        check._sections("flex")
    run = Check(tmp_path, plan(True), 100.0, {"dry_run": True}, only={"gpu-tests-flex"}, always=check.ALWAYS)
    ran = [n for n in ("environment", "data", "probe", "gpu-tests-flex") if run.section(n, lambda: {"x": 1})]
    assert ran == ["environment", "data", "gpu-tests-flex"]
    assert run.sections["probe"]["status"] == "skipped: not in --only"


def test_gpu_check_installs_wheels_without_pip(tmp_path, monkeypatch):
    """An image without pip: the wheels are unpacked into the target folder."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    gpu_wheels.repack_installed("typing-extensions", wheels)
    monkeypatch.setattr(runtime, "has_pip", lambda: False)
    runtime.install_wheels(wheels, tmp_path / "site")
    assert (tmp_path / "site" / "typing_extensions.py").exists()
    assert list((tmp_path / "site").glob("typing_extensions-*.dist-info/METADATA"))


def test_the_site_cache_installs_a_set_of_wheels_once_and_never_a_half_site(tmp_path, monkeypatch):
    """The rehearsal's cache: a repacked wheel (new zip timestamps) has the same digest; the second ask reuses the
    folder without installing; a failed install leaves nothing that a later run would take for a site."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = gpu_wheels.repack_installed("typing-extensions", wheels)
    digest = runtime.wheels_digest(wheels)
    gpu_wheels.repack_installed("typing-extensions", wheels)  # (written anew: its zip entries dated now)
    assert runtime.wheels_digest(wheels) == digest
    installs = []
    real = runtime.install_wheels
    monkeypatch.setattr(runtime, "has_pip", lambda: False)  # unpacked: no pip process in a unit test
    monkeypatch.setattr(runtime, "install_wheels", lambda w, s: (installs.append(s), real(w, s)))
    cache = tmp_path / "cache"
    site = runtime.cached_site(wheels, cache)
    assert site == cache / digest and (site / "typing_extensions.py").exists()
    assert runtime.cached_site(wheels, cache) == site and len(installs) == 1  # reused

    def broken(w, s):
        (s / "half.py").write_text("")
        raise OSError("disk full")

    monkeypatch.setattr(runtime, "install_wheels", broken)
    (wheels / "extra-1.0-py3-none-any.whl").write_bytes(wheel.read_bytes())  # another set of wheels
    with pytest.raises(OSError, match="disk full"):
        runtime.cached_site(wheels, cache)
    assert sorted(p.name for p in cache.iterdir()) == [digest]  # no partial folder left, none named as a site


def test_gpu_check_row_errors_and_kernel_categories():
    assert figures.memory_error(torch.OutOfMemoryError("CUDA out of memory"))
    assert figures.memory_error(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not figures.memory_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert figures.kernel_category("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert figures.kernel_category("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN") == "gemm"
    assert figures.kernel_category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert figures.kernel_category("fmha_cutlassF_bf16_aligned_64x128_rf_sm80") == "attention"
    assert figures.kernel_category("void at::native::multi_tensor_apply_kernel<FusedAdam>") == "optimizer"
    assert figures.kernel_category("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "communication"
    assert figures.kernel_category("void at::native::vectorized_elementwise_kernel<4, silu>") == "elementwise"
    # a sweep cut short: the figures of the rows it has
    rows = [
        {"mode": "difflm-noshift", "micro_batch": 8, "step_s": 1.0, "tflops": 300.0, "mfu": 0.3, "tokens_per_s": 1},
        {"mode": "difflm-noshift", "micro_batch": 12, "oom": False, "error": "RuntimeError: CUDA error: misaligned"},
    ]
    summary = figures.summary("microbatch-1b", plan(False), [{**r, "seq": 2048} for r in rows])
    assert summary["largest_micro_batch"] == 8 and summary["mfu"] == 0.3 and summary["baseline_mfu"] is None


def test_microbatch_figures_come_from_the_unprofiled_steps():
    """MFU without the optimizer: the unprofiled steps' forward+backward; device busy share: kernel time over the
    unprofiled step (a profiled wall would count the profiler's overhead as idle device time); the baseline and
    the repeat are picked by mode and shape."""
    best = {"mode": "difflm-noshift", "seq": 2048, "micro_batch": 24, "step_s": 0.875, "mfu": 0.477}
    rows = [
        {**best, "tflops": 472.0, "forward_backward_s": 0.85},
        {**best, "repeat": True, "mfu": 0.475, "step_s": 0.878, "tflops": 470.0},
        {"mode": "ar", "seq": 2048, "micro_batch": 24, "step_s": 0.82, "mfu": 0.473, "tflops": 468.0},
    ]
    got = figures.summary("microbatch-1b", plan(False), rows)
    assert got["mfu_without_optimizer"] == pytest.approx(0.477 * 0.875 / 0.85)
    assert got["repeat_mfu"] == 0.475 and got["baseline_mfu"] == 0.473 and got["baseline_mode"] == "ar"
    assert got["over_baseline_tflops"] == pytest.approx(472 / 468)
    assert figures.busy_share(828.0, 0.875) == pytest.approx(0.946, abs=1e-3)  # not 828 / 1002 profiled
    assert figures.spread([0.9, 0.8, 1.0, 0.85]) == {"median": 0.875, "min": 0.8, "max": 1.0, "n": 4}


def test_corpus_documents_vary_in_length_and_can_have_a_dominant_successor():
    """Documents of lengths drawn in the plan's range (document masks at long context see many of them); with a
    dominant successor the chain's first choice comes at about that rate (a model can be confident)."""
    import numpy as np

    p = {"documents": 400, "doc_len": [16, 200]}
    table = corpus.markov_table(64)
    docs = corpus.markov_documents(p, table, dominant=0.9)
    lengths = [len(d) for d in docs]
    assert min(lengths) >= 16 and max(lengths) <= 200 and len(set(lengths)) > 50
    first = np.mean([b == table[a][0] for d in docs for a, b in zip(d[:-1], d[1:])])
    assert 0.85 < first < 0.95
    uniform = corpus.markov_documents(p, table)
    assert 0.2 < np.mean([b == table[a][0] for d in uniform for a, b in zip(d[:-1], d[1:])]) < 0.3
    with pytest.raises(ValueError, match="dominant successor"):
        corpus.successor_probabilities(0.1)


def test_check_configs_use_the_current_keys(tmp_path):
    """The check builds its runs in the config tree's current spelling (train.optimizer / train.schedule, no
    deprecated flat aliases), with the section overrides it passes (block size, document masks, the levers)."""
    import warnings

    from benchmarks.gpu.plan import config

    p = plan(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        cfg = config(p, tmp_path, "tiny", 64, "difflm-block", steps=4, diffusion={"block_size": 4})
        knob = config(p, tmp_path, "tiny", 64, "difflm-noshift", model={"recompute": "full", "compile": "rope"})
    assert cfg.train.optimizer.lr == 3e-3 and cfg.train.schedule.warmup_iters == 1 and cfg.train.train_iters == 4
    assert cfg.diffusion.block_size == 4 and cfg.train.precision == "bf16"
    assert knob.model.recompute == "full" and knob.model.compile == "rope"
    assert {k["name"] for k in p["jobs"]["mfu-knobs"]["knobs"]} >= {"off", "recompute=selective", "compile=rope"}
    gpu_knobs = {k["name"]: k for k in plan(False)["jobs"]["mfu-knobs"]["knobs"]}
    assert "compile=layers" in gpu_knobs
    graphs = gpu_knobs["cuda_graphs=layers, 350m"]  # the small model's launch overhead, beside its own off row
    assert graphs["preset"] == gpu_knobs["off, 350m"]["preset"] == "350m" and graphs["shape"] == [2048, 8]
    assert config(p, tmp_path, graphs["preset"], 64, "difflm-noshift", model=graphs["model"]).model.cuda_graphs == (
        "layers"
    )
    assert not any("cuda_graphs" in k.get("model", {}) for k in p["jobs"]["mfu-knobs"]["knobs"])  # no CUDA


def test_decoding_rows_count_model_calls_per_token_and_agreement():
    """The decode section's measurement (shared with benchmarks/generate.py) on tiny models over token ids: the
    calls per token each decoder makes, agreement with the baseline, block diffusion's cache in its settings."""
    from benchmarks.gpu import decode, decoding
    from difflm.models.evaluation.scoring import Scorer

    tok = decoding.IdTokenizer()
    assert tok.encode(tok.decode([5, 17, 3])) == [5, 17, 3]
    texts = ["5 6 7 8", "9 10 11 12", "13 14 15 16"]
    shape = decode.SHAPES["tiny"]
    scorer = Scorer(decoding.random_model(shape, "difflm-noshift"), tok, batch_size=2)
    n = 8
    masked = decode.decoders("difflm-noshift", n)
    base, _, tokens = decoding.measure(scorer, texts, n, decoding.BASELINE, masked[decoding.BASELINE])
    assert base["model_calls_per_token"] == 1 and base["agreement"] == 1 and base["batch_size"] == 2
    assert base["peak_memory_gb"] is None and len(tokens) == 3  # no CUDA: no memory figure
    four, _, _ = decoding.measure(scorer, texts, n, "4", masked["low-confidence, 4 tokens/step"], tokens)
    assert four["model_calls_per_token"] == 0.25 and 0 <= four["agreement"] <= 1
    block = Scorer(decoding.random_model(shape, "difflm-block", block_size=4), tok, batch_size=3)
    rows = {
        k: decoding.measure(block, texts, n, k, f, tokens)[0] for k, f in decode.decoders("difflm-block", n).items()
    }
    cached = rows["block diffusion + KV cache, 1 token/step"]
    assert cached["settings"]["kv_cache"] and cached["settings"]["block_size"] == 4
    assert cached["model_calls_per_token"] == 1.25  # a call per token, and one per finished block for the cache
    assert rows["block diffusion, no KV cache, 1 token/step"]["model_calls_per_token"] == 1
    ar = Scorer(decoding.random_model(shape, "ar"), tok, batch_size=3)
    (name,) = decode.decoders("ar", n)
    assert decoding.measure(ar, texts, n, name, {})[0]["model_calls_per_token"] == 1


def test_decode_goal_wants_both_decoders_at_3x_with_equal_output():
    from benchmarks.gpu import decode, decoding

    table = [[4, 5, 6, 7]] * 8
    assert decode.dominant_share([[4, 4, 4], [4, 5]], table) == 2 / 3 and decode.dominant_share([[9]], table) is None

    def row(sampler, mode, speedup, agreement=1.0, dominant=1.0):
        return {"model": "confident (small)", "batch_size": 16, "sampler": sampler, "mode": mode,
                "speedup": speedup, "agreement": agreement, "dominant_share": dominant}  # fmt: skip

    rows = [
        row(decoding.BASELINE, "difflm-noshift", 1.0),
        row("threshold 0.7 (Fast-dLLM)", "difflm-noshift", 3.5),
        row("threshold 0.5", "difflm-noshift", 6.0, agreement=0.8),  # faster, other output: not counted
        row("block diffusion + KV cache, threshold 0.7", "difflm-block", 3.2),
        row("block diffusion + KV cache, threshold 0.5", "difflm-block", 5.0, dominant=0.5),
        {**row(decoding.BASELINE, "difflm-noshift", 1.0), "model": "smollm2-135m-shaped, random"},
    ]
    assert decode.goal(rows) == {"batch 16": {"threshold_speedup": 3.5, "block_cache_speedup": 3.2, "met": True}}
    assert not decode.goal([*rows[:2], rows[3] | {"speedup": 2.0}])["batch 16"]["met"]


def test_decode_plan_builds_valid_runs_and_generate_shares_the_samplers(tmp_path):
    """The confident models' configs validate at both sizes (block size dividing the length), and
    benchmarks/generate.py uses the decoding module's tables, not copies."""
    import importlib

    from benchmarks.gpu import decode, decoding
    from benchmarks.gpu.plan import config

    for dry in (True, False):
        p = plan(dry)
        d = p["decode"]
        assert d["random"] in decode.SHAPES and d["batches"][0] == 1 and d["seq"] % d["block_size"] == 0
        cfg = config(p, tmp_path, d["preset"], d["seq"], "difflm-block", diffusion={"block_size": d["block_size"]},
                     train={"micro_batch_size": d["mbs"], "global_batch_size": d["mbs"], "optimizer": {"lr": d["lr"]}})  # fmt: skip
        assert cfg.diffusion.block_size == d["block_size"] and cfg.train.optimizer.lr == d["lr"]
        assert d["prompt_len"] + d["new_tokens"] <= decode.SHAPES[d["random"]]["max_position_embeddings"]
    assert plan(False)["decode"]["random"] == "smollm2-135m"
    generate = importlib.import_module("benchmarks.generate")
    assert generate.samplers is decoding.samplers and generate.other_decoders is decoding.other_decoders
    assert "decode" in check.NAMES


def test_decode_section_keeps_what_it_measured_when_training_and_the_worker_fail(tmp_path, monkeypatch):
    """A mode whose training fails is an error of its own; a decoding worker that runs out of time leaves the rows
    it wrote (the trainer and the worker are stood in for: each would start a process)."""
    from benchmarks.gpu import decode

    def no_training(check, name, manifest, mode, tag, **over):
        raise RuntimeError(f"exit 1; {mode} did not train")

    def out_of_time(check, kind, manifest, **extra):
        row = {"model": "confident (tiny)", "mode": "difflm-noshift", "batch_size": 1, "sampler": "x"}
        (check.out / "decode-rows.jsonl").write_text(json.dumps(row) + "\n")
        assert json.loads(Path(extra["models"]).read_text()) == {"folders": {}}
        raise subprocess.TimeoutExpired("torchrun", 10)

    monkeypatch.setattr(decode.training, "train", no_training)
    monkeypatch.setattr(decode, "worker", out_of_time)
    result = decode.section(Check(tmp_path, plan(True), float("inf"), {}), {})
    assert set(result["errors"]) == {"difflm-noshift", "difflm-block", "ar", "decoding"}
    assert "did not train" in result["errors"]["ar"] and "timed out" in result["errors"]["decoding"]
    assert [r["sampler"] for r in result["rows"]] == ["x"] and result["trained"] == {}
