"""The evaluation verbs of `difflm` (`eval`, `eval --reproduce`, `compare`, `eval-latest`, `generate`), given their
validated config and options, and what they print; the other verbs are in `flows/commands.py`, whose rule on
imports holds here too (each imports the stages it runs inside itself: `difflm --help` loads no framework)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from difflm.config import PipelineConfig
from difflm.errors import UserError
from difflm.rundir import Workdir


def eval_latest(run_dir: str, preset: str | None, overrides: list[str], max_sequences: int, force: bool) -> int:
    """The flow evaluate-latest once on RUN_DIR's newest checkpoint."""
    from difflm.flows.evaluate_latest import evaluate_latest
    from difflm.tasks.sources import training_run_dir

    res = evaluate_latest(
        run_dir=str(training_run_dir(run_dir).path),
        preset=preset,
        overrides=overrides,
        max_sequences=max_sequences,
        force=force,
    )
    if res.get("skipped"):
        seen = res.get("iteration") is not None
        detail = f" (iteration {res['iteration']}, score {res['score']:.4f}; --force scores it again)" if seen else ""
        print(f"skipped: {res['skipped']}{detail}")
    else:
        run = f"; MLflow run {res['mlflow_run_id']}" if res.get("mlflow_run_id") else ""
        print(f"iteration {res['iteration']}: {res['kind']} {res['score']:.4f} nats/token (ppl {res['ppl']:.2f}){run}")
    return 0


def evaluate(
    cfg: PipelineConfig,
    sources: list[str],
    preset: str | None,
    overrides: list[str],
    out: str | None,
    tracking_uri: str | None,
    flow: bool,
    force: bool = False,
) -> int:
    """Each SOURCE on its own run's recorded config and data (difflm.tasks.sources.evaluation_source), unless
    --preset or data overrides say otherwise; results on other data go to <run>/eval-<data hash>. A record of the
    same export, data and settings already there (the pipeline's own evaluation) is reused, unless --force; when
    one exists with other settings, the line says which. Prints one table."""
    from difflm.models.evaluation.record import EvalRecord
    from difflm.models.evaluation.report import comparison_table
    from difflm.models.evaluation.stages import evaluate_export, reuse_check, sweep_export
    from difflm.tasks.sources import evaluation_source
    from difflm.tracking import tracking_uri as config_tracking_uri

    found: dict[str, EvalRecord] = {}
    for source in sources:
        if flow:  # Prefect is imported for --flow only
            from difflm.flows.evaluate import evaluate as evaluate_flow

            found[source] = EvalRecord.from_dict(
                evaluate_flow(source=source, preset=preset, overrides=overrides, out_dir=out)
            )
            continue
        plan = evaluation_source(source, preset, overrides, tracking_uri or config_tracking_uri(cfg), out)
        c, manifest, hf_dir, out_dir = plan["config"], plan["manifest"], plan["hf_dir"], plan["out_dir"]
        reused, why = (None, "--force") if force else reuse_check(c, manifest, hf_dir, out_dir)
        if reused is not None:
            print(f"{source}: results in {out_dir} (reused: the same export, data and settings; --force recomputes)")
            found[source] = reused
            continue
        if why:
            print(f"{source}: evaluating again: {why}")
        results = evaluate_export(c, manifest, hf_dir, out_dir, untrained=False)
        sweep = sweep_export(c, manifest, hf_dir, out_dir)
        found[source] = EvalRecord.read(out_dir).replace(report=results.report) if sweep else results
        other = f" (data {manifest.hash}: not the data its run was trained on)" if plan["other_data"] else ""
        print(f"{source}: results in {out_dir}{other}")
    print(comparison_table(found))
    for source, res in found.items():
        for row in res.sweep or []:
            print(
                f"{source} {row.get('setting', 'steps ' + str(row['steps']))}: exact match {row['accuracy']:.3f}, "
                f"TPF {row.get('tpf') or 0:.2f}, {row['tokens_per_s'] or 0:.1f} tokens/s"
            )
        if res.samples:
            s = res.samples[0]
            print(f"{source} sample: {s['prompt']!r} -> {s['completion'][:160]!r}")
    report = next((r.report for r in found.values() if r.report), None)
    if report:
        print(f"report of every run on this data: {report}")
    return 0


def reproduce(record_path: str, overrides: list[str], out: str | None) -> int:
    """`difflm eval --reproduce RECORD`: the record's export, data and settings evaluated again into a folder of
    their own (default: <record folder>/reproduced-<UTC time>); one line per score; exit 1 when one is not
    within its standard error. Overrides change a setting on purpose (the lines then name it)."""
    import datetime

    from difflm.models.evaluation.record import EvalRecord
    from difflm.models.evaluation.reproduce import check_export, reproduction, rerun_overrides
    from difflm.models.evaluation.stages import evaluate_export
    from difflm.tasks.sources import evaluation_source

    path = Path(record_path)
    old = EvalRecord.read(path)
    folder = check_export(old)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    out_dir = Path(out) if out else (path if path.is_dir() else path.parent) / f"reproduced-{stamp}"
    plan = evaluation_source(str(folder), None, [*rerun_overrides(old), *overrides], None, out_dir)
    if plan["manifest"].hash != old.data_hash:
        print(f"difflm: the rerun's data {plan['manifest'].hash} is not the record's {old.data_hash}", file=sys.stderr)
    new = evaluate_export(plan["config"], plan["manifest"], plan["hf_dir"], out_dir, untrained=False)
    ok, lines = reproduction(old, new)
    for line in lines:
        print(line)
    print(f"{'reproduced' if ok else 'NOT reproduced'}: {path} (the rerun's record: {out_dir / 'results.json'})")
    return 0 if ok else 1


def compare(cfg: PipelineConfig, records: list[str], out: str | None) -> int:
    """`difflm compare RECORD...`: the table, points and picture in --out (default <workdir>/reports/compare-<time>),
    and the same as an MLflow run of the config's experiment."""
    import datetime

    from difflm import tracking
    from difflm.models.evaluation.reproduce import compare as compare_records
    from difflm.models.evaluation.reproduce import read_records

    found = read_records(records)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    out_dir = Path(out) if out else Workdir.of(cfg).reports / f"compare-{stamp}"
    files = compare_records(found, out_dir)
    print(files["table"].read_text())
    with tracking.pipeline_run(cfg, f"compare-{stamp}", {"flow": "compare"}) as run_id:
        if run_id:
            tracking.log_files(list(files.values()), "compare")
    for kind, f in files.items():
        print(f"{kind}: {f}")
    if run_id:
        print(f"mlflow run: {run_id}")
    return 0


def generate(
    cfg: PipelineConfig,
    source: str,
    prompts: list[str] | None,
    max_new_tokens: int | None,
    as_json: bool,
    tracking_uri: str | None,
) -> int:
    """Samples from an export after each prompt (default: the first words of held-out documents)."""
    from difflm.data_prep.pipeline import prepare_data
    from difflm.models.evaluation.generation import default_prompts, sampler_settings
    from difflm.models.evaluation.report import placement_label
    from difflm.models.evaluation.scoring import Scorer
    from difflm.models.evaluation.sources import resolve_export
    from difflm.models.evaluation.stages import eval_device, load_model, load_tokenizer, placement
    from difflm.models.evaluation.tasks import heldout_documents
    from difflm.tracking import tracking_uri as config_tracking_uri

    hf_dir = resolve_export(source, tracking_uri or config_tracking_uri(cfg), cfg.tracking)
    model, tok = load_model(hf_dir, *eval_device(cfg.eval)), load_tokenizer(hf_dir)
    prompts = prompts or cfg.eval.prompts
    if not prompts:
        held_out = heldout_documents(prepare_data(cfg), tok)
        prompts = default_prompts(held_out, cfg.eval.num_samples or 3, cfg.eval.prompt_words)
    scorer = Scorer(model, tok, seed=cfg.eval.seed)
    assert scorer.max_length is not None  # the scorer sets it from the model when not given
    length = _new_tokens(hf_dir, scorer.max_length, max_new_tokens, cfg.eval.sample_length)
    records = scorer.generate(prompts, length, sampler_settings(cfg.eval))
    if as_json:
        print(json.dumps(records, indent=2))
        return 0
    for r in records:
        print(
            f"--- {r['prompt']!r}\n{r['completion']}\n    [{r['tokens']} tokens, {r['model_calls']} model calls, "
            f"{r['seconds']:.2f} s]"
        )
    settings = {k: v for k, v in records[0]["sampler"].items() if v is not None} if records else {}
    print(f"sampler: {json.dumps(settings)}\ndevice / dtype: {placement_label(**placement(model))}")
    return 0


def _new_tokens(hf_dir: Path, max_length: int, asked: int | None, configured: int) -> int:
    """How many tokens to generate after a prompt: at most max_length - 1 (one position for the prompt). An asked
    --max-new-tokens beyond that is refused with the maximum; the config's eval.sample_length is capped, with a
    warning (it was silently cut to the model's length)."""
    most = max_length - 1
    if asked is not None and not 1 <= asked <= most:
        raise UserError(
            f"--max-new-tokens {asked}: {hf_dir} generates 1 to {most} tokens after a prompt (its max_length is "
            f"{max_length}): pass --max-new-tokens {most} or less"
        )
    if asked is None and configured > most:
        print(
            f"difflm: warning: eval.sample_length={configured} does not fit {hf_dir} (max_length {max_length}): "
            f"generating {most} tokens",
            file=sys.stderr,
        )
    return asked if asked is not None else min(configured, most)
