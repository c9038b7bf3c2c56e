"""`difflm`: the command line of the pipeline, on the top floor (it dispatches to flows and stages).

Every command takes a preset (`--preset tiny-cpu` or a YAML path) and `section.field=value` overrides;
the configuration is validated before any work starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml

from difflm import set_offline_env
from difflm.config import CONFIG_DIR, ConfigError, PipelineConfig, load_config

EPILOG = """examples:
  difflm run                                   # the demo: tiny-cpu preset, every stage
  difflm run train.train_iters=50 model.num_layers=2
  difflm run --preset configs/my.yaml diffusion.model_running_mode=ar
  difflm config show train.lr=1e-3             # print the resolved configuration
  difflm serve --cron '0 3 * * *'              # a Prefect deployment of pretrain-difflm
  difflm eval .difflm/runs/<run> .difflm/runs/<ar run>   # tasks + bounds, side by side
  difflm convert .difflm/runs/<run>             # newest checkpoint -> <run>/exports/iter_XXXXXXX (HF)
  difflm eval-latest .difflm/runs/<run>         # score the newest checkpoint while it trains, into MLflow
  difflm generate .difflm/runs/<run> --prompt "The river" eval.threshold=0.9 eval.block_length=8
"""


def _offline_env(cfg: PipelineConfig) -> None:
    """Local state and no phoning home; set before Prefect/MLflow/transformers are imported."""
    workdir = Path(cfg.workdir).resolve()
    (workdir / ".prefect").mkdir(parents=True, exist_ok=True)  # Prefect does not create parents
    os.environ.setdefault("PREFECT_HOME", str(workdir / ".prefect"))
    set_offline_env()


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny-cpu", help="preset name in configs/ or a YAML file (default: tiny-cpu)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="configuration overrides")


def cmd_run(cfg: PipelineConfig, args) -> int:
    from data_prep.pipeline import preflight

    preflight(cfg)  # bad paths fail here, before a Prefect server starts
    from flows.pretrain import pretrain_difflm

    summary = pretrain_difflm(config=cfg)
    b = summary["validation"]
    from models.evaluation.likelihood import KIND_LABELS

    kind = KIND_LABELS[b["trained"]["kind"]]
    print("\n=== pretrain-difflm done ===")
    print(f"validation {kind}: trained {b['trained']['ppl']:.1f}  untrained {b['untrained']['ppl']:.1f}"
          f"  ({b['trained']['nll_per_token']:.3f} vs {b['untrained']['nll_per_token']:.3f} nats/token)")
    for name, scores in summary.get("tasks", {}).items():
        print(f"task {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items() if isinstance(v, float)
                                           and k != "chance") + f"  ({scores['items']} items)")
    for s in summary["samples"]:
        print(f"sample: {s['prompt']!r} -> {s['completion'][:160]!r}")
    if summary.get("stages"):  # what this execution computed, and what the Prefect cache let it skip
        print("stages: " + ", ".join(f"{k} {v}" for k, v in summary["stages"].items()))
    for key in ("data_dir", "run_dir", "hf_dir", "report", "mlflow_uri", "mlflow_run_id", "mlflow_run_url",
                "registered_model", "version", "promotion"):
        if summary.get(key) is not None:
            print(f"{key:>16}: {summary[key]}")
    if summary.get("mlflow_uri"):
        print(f"MLflow UI: {Path(sys.executable).parent / 'mlflow'} ui --backend-store-uri {summary['mlflow_uri']} "
              f"--host 127.0.0.1 --port 5000")
    Path(cfg.workdir, "last_run.json").write_text(json.dumps(summary, indent=2))
    return 0


def cmd_config(cfg: PipelineConfig, args) -> int:
    if args.action == "presets":
        for p in sorted(CONFIG_DIR.glob("*.yaml")):
            first = next((ln.lstrip("# ").strip() for ln in p.read_text().splitlines() if ln.startswith("#")), "")
            print(f"{p.stem:<12} {first}")
        return 0
    if args.action == "schema":
        print(json.dumps(PipelineConfig.model_json_schema(), indent=2))
        return 0
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def cmd_prep(cfg: PipelineConfig, args) -> int:
    from data_prep.pipeline import DataPrepError, SubmittedToCluster
    from data_prep.tokenizer import TokenizerError
    from data_prep.verify import DataVerificationError

    try:
        if args.flow:
            from flows.data_prep import data_prep

            m = data_prep(config=cfg)
        else:
            from data_prep.pipeline import prepare_data

            m = prepare_data(cfg)
    except SubmittedToCluster as note:
        print(f"difflm: {note}")
        return 0
    except (DataPrepError, TokenizerError, DataVerificationError) as err:
        print(f"difflm: {err}", file=sys.stderr)
        return 1
    print(f"data: {m['dir']}")
    for split, s in m["splits"].items():
        per = ", ".join(f"{k} {v['documents']} docs/{v['tokens']:,} tok" for k, v in s["sources"].items())
        print(f"  {split:>5}: {s['documents']:>7} documents {s['tokens']:>12,} tokens  ({per})")
    if m.get("skipped"):
        print("  skipped/dropped: " + ", ".join(f"{k}={v}" for k, v in m["skipped"].items()))
    print(f"  tokenizer: vocab {m['tokenizer']['vocab_size']}, sha256 {m['tokenizer']['sha256'][:12]}")
    print(f"  train data path: {m['splits']['train']['data_path'][:200]}")
    return 0


def cmd_verify(cfg: PipelineConfig, args) -> int:
    from data_prep.pipeline import MANIFEST, data_dir
    from data_prep.verify import DataVerificationError, verify

    path = data_dir(cfg) / MANIFEST
    if not path.exists():
        print(f"difflm: no finished data prep for this config at {path.parent}; run `difflm prep` first",
              file=sys.stderr)
        return 1
    try:
        report = verify(json.loads(path.read_text()))
    except DataVerificationError as err:
        print(f"difflm: {err}", file=sys.stderr)
        return 1
    print(f"ok: {report['shards']} shards, {report['documents']} documents, {report['tokens']:,} tokens verified")
    return 0


def cmd_train(cfg: PipelineConfig, args) -> int:
    from data_prep.pipeline import prepare_data
    from models.launch.cluster import submit_kubernetes, submit_slurm
    from models.launch.torchrun import launch_training

    launch = {"slurm": submit_slurm, "kubernetes": submit_kubernetes}.get(cfg.train.launcher, launch_training)
    print(json.dumps(launch(cfg, prepare_data(cfg)), indent=2))
    return 0


def cmd_launch(cfg: PipelineConfig, args) -> int:
    from data_prep.pipeline import prepare_data
    from models.launch.cluster import mount_problem, write_launch_file
    from models.launch.torchrun import run_dir

    # the options override train.slurm.* / train.kubernetes.* (the settings train.launcher=slurm|kubernetes uses)
    for section, options in ((cfg.train.slurm, ("partition", "time", "python")),
                             (cfg.train.kubernetes, ("image", "pvc"))):
        for name in options:
            if getattr(args, name) is not None:
                setattr(section, name, getattr(args, name))
    target = "kubernetes" if args.target in ("k8s", "kubernetes") else "slurm"
    manifest = prepare_data(cfg)
    rdir = run_dir(cfg, manifest)
    out = write_launch_file(cfg, manifest, target)
    hint = f"sbatch {out}" if target == "slurm" else f"kubectl apply -f {out}"
    print(f"{args.target} launch file: {out}\nsubmit: {hint}\nrun directory (checkpoints, metrics): {rdir}")
    if target == "kubernetes" and mount_problem(cfg, rdir):
        print(f"difflm: warning: {mount_problem(cfg, rdir)}", file=sys.stderr)
    return 0


def cmd_convert(cfg: PipelineConfig, args) -> int:
    """`convert` (either direction, inferred) and `import-hf` (HF -> megatron): one path, plain or as the flow."""
    from tasks.runs import conversion_source, convert_source, stage_config

    source, to = (args.hf_dir, "megatron") if args.command == "import-hf" else (args.source, args.to)
    found = conversion_source(source, to)  # a folder that is neither fails here, before any Prefect server
    if args.preset is None:  # no preset: the run's own config.yaml when the source belongs to a run
        cfg = stage_config(found["run_dir"], None, args.overrides)
    _offline_env(cfg)  # Prefect's state beside the run's workdir, not in the current directory
    if args.flow:
        from flows.convert import convert_checkpoint

        info = convert_checkpoint(source=source, to=to, out_dir=args.out, config=cfg)
    else:
        info = convert_source(cfg, found, args.out)
    out = info["out_dir"]
    if info["to"] == "megatron":
        print(f"megatron checkpoint: {out}\nstart training from it with: train.init_from={out}")
    else:
        print(f"Hugging Face export: {out}" + (" (reused)" if info["reused"] else "")
              + (f"\n  from iteration {info['iteration']} of {info['run_dir']}" if info["run_dir"] else ""))
    return 0


def cmd_eval_latest(cfg: PipelineConfig, args) -> int:
    from tasks.runs import stage_config, training_run_dir

    rdir = training_run_dir(args.run_dir)  # a wrong path fails here, before any Prefect server starts
    _offline_env(stage_config(rdir, args.preset, args.overrides))  # Prefect's state beside the run's workdir
    from flows.evaluate_latest import evaluate_latest

    res = evaluate_latest(run_dir=str(rdir), preset=args.preset, overrides=args.overrides,
                          max_sequences=args.max_sequences, force=args.force)
    if res.get("skipped"):
        print(f"skipped: {res['skipped']}" + (f" (iteration {res['iteration']}, score {res['score']:.4f}; "
                                              f"--force scores it again)" if res.get("iteration") is not None else ""))
    else:
        print(f"iteration {res['iteration']}: {res['kind']} {res['score']:.4f} nats/token (ppl {res['ppl']:.2f})"
              + (f"; MLflow run {res['mlflow_run_id']}" if res.get("mlflow_run_id") else ""))
    return 0


def cmd_eval(cfg: PipelineConfig, args) -> int:
    from data_prep.pipeline import prepare_data
    from models.evaluation.report import comparison_table
    from difflm.tracking import tracking_uri
    from models.evaluation.sources import resolve_export
    from models.evaluation.stages import default_out_dir, evaluate_export, sweep_export

    if args.flow:
        from flows.evaluate import evaluate

        found = {s: evaluate(source=s, config=cfg, out_dir=args.out) for s in args.sources}
    else:
        manifest = prepare_data(cfg)
        found = {}
        for source in args.sources:
            hf_dir = resolve_export(source, args.tracking_uri or tracking_uri(cfg))
            out = Path(args.out) if args.out else default_out_dir(cfg, source, hf_dir)
            found[source] = evaluate_export(cfg, manifest, hf_dir, out, untrained=False)
            found[source]["sweep"] = sweep_export(cfg, manifest, hf_dir, out)
            print(f"{source}: results in {out}")
    print(comparison_table(found))
    for source, res in found.items():
        for row in res.get("sweep") or []:
            print(f"{source} steps {row['steps']:>3}: cloze accuracy {row['accuracy']:.3f}, "
                  f"{row['tokens_per_s']:.1f} tokens/s")
        if res.get("samples"):
            s = res["samples"][0]
            print(f"{source} sample: {s['prompt']!r} -> {s['completion'][:160]!r}")
    report = next(iter(found.values())).get("report")
    if report:
        print(f"report of every run on this data: {report}")
    return 0


def cmd_generate(cfg: PipelineConfig, args) -> int:
    from models.evaluation.generation import default_prompts, sampler_settings
    from models.evaluation.report import placement_label
    from models.evaluation.scoring import Scorer
    from difflm.tracking import tracking_uri
    from models.evaluation.sources import resolve_export
    from models.evaluation.stages import eval_device, load_model, load_tokenizer, placement

    hf_dir = resolve_export(args.source, args.tracking_uri or tracking_uri(cfg))
    model, tok = load_model(hf_dir, *eval_device(cfg.eval)), load_tokenizer(hf_dir)
    prompts = args.prompt or cfg.eval.prompts
    if not prompts:
        from data_prep.pipeline import prepare_data
        from models.evaluation.tasks import heldout_documents

        prompts = default_prompts(heldout_documents(prepare_data(cfg), tok), cfg.eval.num_samples or 3,
                                  cfg.eval.prompt_words)
    scorer = Scorer(model, tok, seed=cfg.eval.seed)
    records = scorer.generate(prompts, args.max_new_tokens or cfg.eval.sample_length, sampler_settings(cfg.eval))
    if args.json:
        print(json.dumps(records, indent=2))
        return 0
    for r in records:
        print(f"--- {r['prompt']!r}\n{r['completion']}\n    [{r['tokens']} tokens, {r['model_calls']} model calls, "
              f"{r['seconds']:.2f} s]")
    settings = {k: v for k, v in records[0]["sampler"].items() if v is not None} if records else {}
    print(f"sampler: {json.dumps(settings)}\ndevice / dtype: {placement_label(placement(model))}")
    return 0


def cmd_serve(cfg: PipelineConfig, args) -> int:
    """Serve a flow as a deployment of this process: pretrain-difflm (the config), or evaluate-latest on a run."""
    from prefect.deployments.runner import EntrypointType

    # flow runs load the flow by module (flows.pretrain), not by file: a file puts flows/ first on sys.path,
    # where flows/data_prep.py would shadow the data_prep package
    schedule = {"cron": args.cron} if args.cron else {"interval": args.interval} if args.interval else {}
    schedule["entrypoint_type"] = EntrypointType.MODULE_PATH
    if args.flow == "evaluate-latest":
        schedule = schedule if len(schedule) > 1 else {**schedule, "interval": 600}
        from flows.evaluate_latest import evaluate_latest
        from tasks.runs import training_run_dir

        if not args.run_dir:
            raise SystemExit("difflm serve --flow evaluate-latest needs --run-dir <workdir>/runs/<run> (the run to "
                             "score while it trains)")
        params = {"run_dir": str(training_run_dir(args.run_dir)), "max_sequences": args.max_sequences,
                  "overrides": args.overrides}
        if args.preset:  # else the run's own config.yaml
            params["preset"] = args.preset
        print(f"serving evaluate-latest/{args.name} on {params['run_dir']}"
              + (f" every {args.interval:g} s" if args.interval and not args.cron else ""), flush=True)
        evaluate_latest.serve(name=args.name, parameters=params, limit=1, **schedule)  # one at a time
        return 0
    from flows.pretrain import pretrain_difflm

    pretrain_difflm.serve(name=args.name, parameters={"preset": args.preset or "tiny-cpu", "overrides": args.overrides},
                          **schedule)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="difflm", description="Pretrain diffusion language models on megatron-core, data to registered checkpoint.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run the pretrain-difflm flow end to end (data, train, export, eval, MLflow)",
                       description="Run the Prefect flow pretrain-difflm: data prep, torchrun training, HF export, "
                       "evaluation, MLflow tracking and model registration. Finished stages are reused; an "
                       "interrupted run resumes. With no Prefect API configured a temporary local server is used.")
    _add_config_args(p)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("config", help="show the resolved configuration, list presets, or print the JSON schema")
    p.add_argument("action", nargs="?", default="show", choices=["show", "presets", "schema"],
                   help="show (default): the resolved config; presets: the preset files; schema: JSON schema")
    _add_config_args(p)
    p.set_defaults(func=cmd_config)
    p = sub.add_parser("prep", help="data prep only: datatrove -> tokenized Megatron .bin/.idx + manifest",
                       description="Read the configured sources (data.sources), clean, split, tokenize and write "
                       "verified Megatron datasets. Reruns finish interrupted work; a changed config writes to a "
                       "new folder.")
    _add_config_args(p)
    p.add_argument("--flow", action="store_true", help="run as the Prefect flow `data-prep`, logging to MLflow")
    p.set_defaults(func=cmd_prep)
    p = sub.add_parser("verify", help="re-read and check every shard of the config's finished data prep")
    _add_config_args(p)
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("train", help="data prep (reused) + torchrun training only, no Prefect/MLflow")
    _add_config_args(p)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("launch", help="write a Slurm script or Kubernetes PyTorchJob that trains this config",
                       description="Prepare the data (reused when done), then write a cluster launch file for "
                       "torchrun on train.nnodes nodes x train.nproc_per_node GPUs into the run directory. The "
                       "workdir must be on storage every node sees. train.launcher=slurm|kubernetes also submits "
                       "it and waits (difflm train, difflm run, the pretrain-difflm flow).")
    p.add_argument("--target", choices=["slurm", "k8s", "kubernetes"], default="slurm")
    p.add_argument("--partition", default=None, help="Slurm partition (default: train.slurm.partition)")
    p.add_argument("--time", default=None, help="Slurm time limit (default: train.slurm.time, 24:00:00)")
    p.add_argument("--python", default=None, help="python on the nodes (default: train.slurm.python, else this one)")
    p.add_argument("--image", default=None, help="container image (k8s; default: train.kubernetes.image)")
    p.add_argument("--pvc", default=None, help="PersistentVolumeClaim holding the workdir (k8s; default: "
                   "train.kubernetes.pvc)")
    _add_config_args(p)
    p.set_defaults(func=cmd_launch)
    p = sub.add_parser("convert", help="megatron checkpoint <-> HF folder (a run directory: its newest checkpoint)",
                       description="Convert a run directory (its newest complete checkpoint), a megatron checkpoint "
                       "(iter_XXXXXXX) or an HF export; the direction follows from the source (or --to). With no "
                       "--preset, the run's own config.yaml describes the model; for HF -> megatron the config's "
                       "parallel.* sets the vocabulary padding of the target layout.")
    p.add_argument("source", help="run directory, checkpoint folder, or HF export folder")
    p.add_argument("--to", choices=["hf", "megatron"], default=None, help="direction (default: from the source)")
    p.add_argument("--out", default=None, help="output folder (default: <run>/exports/iter_XXXXXXX, or next to "
                   "the source as <name>-hf / <name>-megatron)")
    p.add_argument("--flow", action="store_true", help="run as the Prefect flow `convert-checkpoint`")
    p.add_argument("--preset", default=None, help="preset or YAML (default: the run's config.yaml, else tiny-cpu)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="configuration overrides")
    p.set_defaults(func=cmd_convert)
    p = sub.add_parser("import-hf", help="HF folder (this project's format) -> megatron checkpoint for train.init_from",
                       description="Convert an exported Hugging Face folder back into a megatron distributed "
                       "checkpoint (model weights). The model.* config must describe the same architecture. "
                       "The same as `difflm convert HF_DIR --to megatron`.")
    p.add_argument("hf_dir", help="folder with config.json, model.safetensors and tokenizer.json")
    p.add_argument("--out", required=True, help="output checkpoint folder")
    p.add_argument("--flow", action="store_true", help="run as the Prefect flow `convert-checkpoint`")
    _add_config_args(p)
    p.set_defaults(func=cmd_convert)
    p = sub.add_parser("eval", help="score exports, run directories or registered versions on the data's tasks",
                       description="For each SOURCE: the likelihood bound (exact NLL for ar) on held-out windows, "
                       "the cloze / multiple-choice / document tasks built from the held-out split of the config's "
                       "data (the same items for every source), and samples. Prints one table; results and "
                       "lm-eval task files go to <run>/eval (or --out). eval.* overrides set the items, Monte-Carlo "
                       "samples and sampler; eval.steps_sweep=[4,8,16] adds a quality/speed sweep.")
    p.add_argument("sources", nargs="+", metavar="SOURCE",
                   help="export folder, run directory, or models:/<name>/<version> | models:/<name>@<alias>")
    p.add_argument("--out", default=None, help="results folder (default: <run>/eval or <workdir>/evals/<source>)")
    p.add_argument("--tracking-uri", default=None, help="MLflow store for models:/ sources (default: the config's)")
    p.add_argument("--flow", action="store_true", help="run as the Prefect flow `evaluate`, logging to MLflow")
    _add_config_args(p)
    p.set_defaults(func=cmd_eval)
    p = sub.add_parser("eval-latest", help="score a training run's newest checkpoint (the flow evaluate-latest)",
                       description="Run the Prefect flow evaluate-latest once: export the newest complete "
                       "checkpoint of RUN_DIR (it may still be training), score its held-out likelihood bound on a "
                       "few windows and log it to MLflow at that iteration (the training's MLflow run when found). "
                       "A checkpoint scored before is skipped (<run>/eval_latest/scores.json). prefect.yaml "
                       "schedules it every 10 minutes.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="training run directory (<workdir>/runs/<run>)")
    p.add_argument("--max-sequences", type=int, default=16,
                   help="held-out windows to score (default: 16; at most eval.max_sequences of the config)")
    p.add_argument("--force", action="store_true", help="score the newest checkpoint even if scored before")
    p.add_argument("--preset", default=None, help="preset or YAML (default: the run's config.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="configuration overrides")
    p.set_defaults(func=cmd_eval_latest)
    p = sub.add_parser("generate", help="sample from an export with the configured sampler",
                       description="Generate after each --prompt (default: the first words of held-out documents). "
                       "The sampler is eval.*: sampler_steps, block_length, remasking (low_confidence | margin | "
                       "entropy | random), threshold (Fast-dLLM parallel decoding), temperature, top_k, top_p, "
                       "cfg_scale, stop_at_eos. ar exports decode token by token with a KV cache.")
    p.add_argument("source", metavar="SOURCE", help="export folder, run directory, or models:/<name>/<version>")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate (default: eval.sample_length)")
    p.add_argument("--json", action="store_true", help="print the records (completion, settings, timing) as JSON")
    p.add_argument("--tracking-uri", default=None, help="MLflow store for models:/ sources")
    _add_config_args(p)
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("serve", help="serve pretrain-difflm (or evaluate-latest) as a Prefect deployment, optionally "
                       "on a schedule", description="Register a deployment and run its flow runs in this process "
                       "until stopped (Ctrl-C). pretrain-difflm takes the config (--preset and overrides); "
                       "evaluate-latest scores the newest checkpoint of --run-dir on every scheduled run "
                       "(default: every 600 s) and logs it to MLflow at that step. For a work pool and a worker "
                       "instead, see prefect.yaml (`prefect deploy`).")
    _add_config_args(p)
    p.set_defaults(preset=None)  # pretrain-difflm: tiny-cpu; evaluate-latest: the run's own config.yaml
    p.add_argument("--flow", choices=["pretrain-difflm", "evaluate-latest"], default="pretrain-difflm",
                   help="which flow to serve (default: pretrain-difflm)")
    p.add_argument("--name", default="demo", help="deployment name (run it: prefect deployment run 'FLOW/NAME')")
    p.add_argument("--cron", default=None, help="cron schedule, e.g. '0 3 * * *'")
    p.add_argument("--interval", type=float, default=None, help="interval schedule in seconds (evaluate-latest "
                   "default: 600)")
    p.add_argument("--run-dir", default=None, help="evaluate-latest: the training run directory to score")
    p.add_argument("--max-sequences", type=int, default=16,
                   help="evaluate-latest: held-out windows per score (default: 16; at most eval.max_sequences)")
    p.set_defaults(func=cmd_serve)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message already says what to do: printed plainly, without a traceback."""
    from data_prep.pipeline import DataPrepError
    from data_prep.tokenizer import TokenizerError
    from data_prep.verify import DataVerificationError
    from data_prep.corpus import CorpusError
    from models.evaluation.sources import SourceError
    from models.evaluation.stages import EvaluationError
    from models.hf.convert import ConversionError
    from models.launch.torchrun import TrainingError

    return (DataPrepError, TokenizerError, DataVerificationError, CorpusError, ConversionError, TrainingError,
            SourceError, EvaluationError)


def _parse(argv: list[str] | None):
    """Overrides may come before or after options (`config show --preset x a.b=1`): argparse leaves
    positionals that follow an option unparsed, so collect those `key=value` leftovers here."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if "=" not in x or x.startswith("-")]
    if stray:
        dashed = [x.lstrip("-") for x in stray if x.startswith("--") and "=" in x]
        hint = (f" (configuration overrides take no dashes: {' '.join(dashed)}; `difflm config show` lists every "
                f"field)") if dashed else ""
        parser.error(f"unrecognized arguments: {' '.join(stray)}{hint}")
    args.overrides = [*getattr(args, "overrides", []), *extra]
    if getattr(args, "sources", None):  # nargs="+" also swallows the key=value overrides that follow
        args.overrides += [x for x in args.sources if _is_override(x)]
        args.sources = [x for x in args.sources if not _is_override(x)]
        if not args.sources:
            parser.error("eval needs at least one SOURCE (export folder, run directory or models:/name/version)")
    return args


def _is_override(arg: str) -> bool:
    key = arg.split("=", 1)[0]
    return "=" in arg and not arg.startswith("models:/") and all(part.isidentifier() for part in key.split("."))


def main(argv: list[str] | None = None) -> int:
    import warnings

    # megatron warns at import that Apex/TE are absent; on a CPU that is expected, not news
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*")
    args = _parse(argv)
    try:
        cfg = load_config(args.preset, args.overrides)
    except ConfigError as err:
        print(f"difflm: {err}", file=sys.stderr)
        return 2
    if not (args.command in ("convert", "eval-latest") and args.preset is None):
        _offline_env(cfg)  # those two take the config (and workdir) of the run they are given, and set it then
    try:
        return args.func(cfg, args)
    except _user_errors() as err:
        print(f"difflm: {err}", file=sys.stderr)
        return getattr(err, "exit_code", 1)  # TrainingPreempted: 75 (EX_TEMPFAIL), rerun to resume
    except KeyboardInterrupt:
        print("difflm: interrupted; rerun the same command to resume (finished stages and checkpoints are kept)",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
