"""Evaluation as users run it: tasks from the held-out split, `difflm eval` / `difflm generate`, and
lm-evaluation-harness through its own entry point, on exports of the test-tiny data (random weights:
no megatron needed, the numbers are not the point, the plumbing is)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

from benchmarks.gpu.decoding import AR, other_decoders, samplers
from difflm.config import load_config, save_config
from difflm.models.diffusion import MaskedSampler
from difflm.models.evaluation.progress import Progress
from difflm.models.evaluation.scoring import Scorer
from difflm.models.evaluation.stages import load_model, load_tokenizer
from difflm.models.evaluation.tasks import build_items, heldout_documents, score_tasks, write_lm_eval_tasks
from difflm.rundir import Workdir


@pytest.fixture(scope="module")
def items(tiny_manifest, exports):
    docs = heldout_documents(tiny_manifest, load_tokenizer(exports["ar"]))
    return docs, build_items(docs, 6, seed=0)


def test_tasks_come_from_the_heldout_split_and_are_reproducible(items, tiny_manifest, exports):
    docs, tasks = items
    assert len(docs) == tiny_manifest.split("valid").documents
    assert tasks == build_items(heldout_documents(tiny_manifest, load_tokenizer(exports["ar"])), 6, seed=0)
    assert tasks != build_items(docs, 6, seed=1)
    cloze, choice = tasks["cloze"], tasks["choice"]
    assert len(cloze) == 6 and len(choice) == 6
    for it in cloze:  # the target is the word that ends a sentence right after the context, in a document
        assert it["target"].isalpha() or "-" in it["target"] or "'" in it["target"]
        assert any(" ".join(f"{it['context']} {it['target']}".split()) in " ".join(d.split()) for d in docs)
    for it in choice:
        assert len(it["choices"]) == 4 and len(set(it["choices"])) == 4 and 0 <= it["gold"] < 4
        true = " ".join(f"{it['context']} {it['choices'][it['gold']]}".split())
        assert any(true in " ".join(d.split()) for d in docs)


def test_scorer_tasks_and_generation_on_every_mode(exports, items):
    _, tasks = items
    for mode, folder in exports.items():
        scorer = Scorer(load_model(folder), load_tokenizer(folder), mc_samples=4)
        scores = score_tasks(scorer, tasks)
        if scorer.model.objective.has_greedy:
            assert 0 <= scores["cloze"]["acc"] <= 1
        else:  # uniform noise has no greedy order: not measured, rather than a published 0.000
            assert scores["cloze"]["acc"] is None
        # the task's NLL is the scorer's own log-likelihood of those items
        own = scorer.loglikelihood([(it["context"], " " + it["target"]) for it in tasks["cloze"]])
        assert scores["cloze"]["nll"] > 0
        assert scores["cloze"]["nll"] == pytest.approx(-sum(ll for ll, _ in own) / len(own), rel=1e-9)
        assert scores["choice"]["items"] == 6 and scores["documents"]["bits_per_byte"] > 0
        lines: list[str] = []
        scorer.progress = Progress("tasks", "requests", lines.append, every_s=0.0)  # shown as training shows steps
        assert score_tasks(scorer, tasks) == scores  # seeded per request: the same numbers again
        done = scorer.progress.total
        assert done > 0 and lines[-1].startswith(f"[eval] tasks: {done}/{done} requests, ") and "ETA 0 s" in lines[-1]
        scorer.progress = None
        # a request's score does not depend on the batch it is in
        pair = (tasks["cloze"][0]["context"], " " + tasks["cloze"][0]["target"])
        alone = Scorer(scorer.model, scorer.tokenizer, mc_samples=4, batch_size=1).loglikelihood([pair])[0][0]
        assert scorer.loglikelihood([pair, ("The", " end of it")])[0][0] == pytest.approx(alone, rel=1e-6)
        recs = scorer.generate(["The river", "In 1850 the town of"], 6, MaskedSampler(steps=3, block_length=3))
        assert len(recs) == 2 and all(r["sampler"]["mode"] == mode and r["tokens"] <= 6 for r in recs)


def _difflm(*args: str, workdir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # the workdir's store
    return subprocess.run(
        [sys.executable, "-m", "difflm.flows.cli", *args, "--preset", "test-tiny", f"workdir={workdir}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )


@pytest.mark.slow
def test_difflm_eval_and_generate_commands(exports, session_dir, tmp_path):
    workdir = session_dir / "shared"  # the tiny_manifest's data: reused, not prepared again
    out = _difflm(
        "eval",
        str(exports["difflm-noshift"]),
        str(exports["ar"]),
        "eval.task_items=4",
        "eval.mc_samples=2",
        "eval.steps_sweep=[1,2]",
        "--out",
        str(tmp_path / "ev"),
        workdir=workdir,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| difflm-noshift |" in out.stdout and "| ar |" in out.stdout and "cloze acc" in out.stdout
    assert "steps 2: exact match" in out.stdout and "TPF" in out.stdout
    res = json.loads((tmp_path / "ev" / "results.json").read_text())  # the last source's results
    assert res["mode"] == "ar" and res["task_settings"]["mc_samples"] == 2
    assert (tmp_path / "ev" / "lm_eval_tasks" / "difflm_choice.yaml").exists()

    gen = _difflm(
        "generate",
        str(exports["difflm-noshift"]),
        "--prompt",
        "The river",
        "--prompt",
        "A",
        "--json",
        "eval.threshold=0.5",
        "eval.block_length=4",
        "--max-new-tokens",
        "8",
        workdir=workdir,
    )
    assert gen.returncode == 0, gen.stderr[-3000:]
    records = json.loads(gen.stdout[gen.stdout.index("[") :])
    assert [r["prompt"] for r in records] == ["The river", "A"]
    assert records[0]["sampler"]["threshold"] == 0.5 and records[0]["sampler"]["block_length"] == 4

    bad = _difflm("eval", str(tmp_path / "nowhere"), workdir=workdir)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
    assert "no such file or folder; pass an export folder" in bad.stderr.strip().splitlines()[-1], bad.stderr
    notexport = tmp_path / "plain"
    notexport.mkdir()
    bad = _difflm("eval", str(notexport), workdir=workdir)
    assert bad.returncode == 1 and "not an export folder" in bad.stderr and "Traceback" not in bad.stderr


def test_generate_refuses_more_tokens_than_the_model_has_and_never_creates_a_store(exports, session_dir, tmp_path):
    """`--max-new-tokens 64` on a 32-position model returned 31 tokens without a word; `generate models:/...` with
    no store looked in the default workdir, failed, and left an empty mlflow.db there."""
    workdir = session_dir / "shared"
    long = _difflm(
        "generate", str(exports["difflm-noshift"]), "--prompt", "A", "--max-new-tokens", "64", workdir=workdir
    )
    assert long.returncode == 1 and "Traceback" not in long.stderr, long.stderr[-3000:]
    assert long.stderr.strip().splitlines()[-1].endswith("pass --max-new-tokens 31 or less"), long.stderr[-3000:]

    empty = tmp_path / "empty"
    reg = _difflm("generate", "models:/difflm-test-tiny@champion", workdir=empty)
    assert reg.returncode == 1 and "Traceback" not in reg.stderr, reg.stderr[-3000:]
    assert f"no MLflow store at {empty / 'mlflow.db'}" in reg.stderr.strip().splitlines()[-1], reg.stderr[-3000:]
    assert not (empty / "mlflow.db").exists()


def test_the_docs_python_snippet_finds_the_last_run_of_any_preset(exports, tmp_path):
    """The docs' "Using the export in Python" read `.difflm/last_run.json`: after a run of the test preset (workdir
    .difflm-test) it raised FileNotFoundError. It reads the workdir the last run recorded in `.difflm-last`."""
    docs = (ROOT / "docs" / "evaluation.md").read_text()
    blocks = [b.split("```", 1)[0] for b in docs.split("## Using the export in Python", 1)[1].split("```python\n")[1:]]
    snippet = next(b for b in blocks if "Workdir.last()" in b)  # the block that finds hf_dir
    workdir = Workdir(tmp_path / ".difflm-test")  # as `difflm run --preset test-tiny` leaves it (flows/commands.py)
    workdir.path.mkdir()
    workdir.last_run_file.write_text(json.dumps({"hf_dir": str(exports["difflm-noshift"])}))
    workdir.remember(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.slow
def test_lm_eval_runs_difflm_through_its_own_entry_point(exports, items, tmp_path):
    """loglikelihood, multiple_choice, loglikelihood_rolling and generate_until on local task files."""
    _, tasks = items
    task_dir = write_lm_eval_tasks(tasks, tmp_path / "tasks")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for mode, folder in exports.items():
        out = tmp_path / f"out-{mode}"
        cmd = [
            sys.executable,
            "-m",
            "difflm.models.evaluation.lm_eval_adapter",
            "--model",
            "difflm",
            "--model_args",
            # trust_remote_code: what users pass for LLaDA and Dream; accepted, and said to be ignored
            f"pretrained={folder},trust_remote_code=True,mc_samples=2,steps=2,block_length=2",
            "--tasks",
            "difflm_cloze,difflm_choice,difflm_documents,difflm_cloze_gen",
            "--include_path",
            str(task_dir),
            "--batch_size",
            "4",
            "--output_path",
            str(out),
        ]
        run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-4000:]
        assert "never runs code from the folder" in run.stderr
        results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
        assert 0 <= results["difflm_choice"]["acc,none"] <= 1
        assert 0 <= results["difflm_cloze"]["acc,none"] <= 1 and results["difflm_cloze"]["perplexity,none"] > 1
        assert results["difflm_documents"]["bits_per_byte,none"] > 0
        assert 0 <= results["difflm_cloze_gen"]["exact_match,none"] <= 1


def test_generate_benchmark_runs(exports, session_dir, tmp_path):
    """benchmarks/generate.py on a tiny export: every sampler runs and is compared with the baseline."""
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/generate.py",
            str(exports["difflm-noshift"]),
            "--preset",
            "test-tiny",
            "--items",
            "3",
            "--new-tokens",
            "8",
            "--json",
            str(tmp_path / "g.json"),
            f"workdir={session_dir / 'shared'}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "g.json").read_text())["rows"]
    # the masked export's samplers, then one row per decoder of any block / ar export other tests left in the
    # shared workdir (the benchmark adds the workdir's newest of each)
    assert [r["sampler"] for r in rows[:11]] == list(samplers(8)) and rows[0]["agreement"] == 1.0
    assert {r["sampler"] for r in rows[11:]} <= {AR, *other_decoders(8)}
    assert rows[10]["settings"]["prefix_cache"] and rows[10]["model_calls_per_batch"] == 8
    assert {r["model_calls_per_batch"] for r in rows[:3]} == {8, 4, 2}  # 1, 2 and 4 tokens per step
    assert all(r["model_calls_per_batch"] <= 8 for r in rows if "threshold" in r["sampler"])


def test_the_generate_benchmark_reads_the_sources_own_data(tmp_path):
    """`benchmarks/generate.py SOURCE` prepared tiny-cpu's data whatever SOURCE was trained on: it takes the config
    its run recorded (hence its data), unless --preset says otherwise."""
    generate = importlib.import_module("benchmarks.generate")
    run = tmp_path / "work" / "runs" / "difflm-noshift-abc-def"
    (run / "checkpoints").mkdir(parents=True)
    save_config(load_config("test-tiny", ["data.valid_fraction=0.25"]), run / "config.yaml")
    (run / "data_manifest.json").write_text("{}")
    own = generate.source_config(str(run / "hf"), None, [])
    assert own.name == "test-tiny" and own.data.valid_fraction == 0.25 and Path(own.workdir) == tmp_path / "work"
    assert generate.source_config(str(run / "hf"), "test-tiny", []).data.valid_fraction != 0.25
    assert generate.source_config(None, None, []).name == "tiny-cpu"
