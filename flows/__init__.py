"""The top floor: Prefect flows, thin wiring of `tasks` (pretrain-difflm, data-prep, evaluate, convert-checkpoint,
evaluate-latest), tracked in MLflow; and the command line `difflm` (`cli.py`), which dispatches to them and to the
plain stages.

May import everything below: tasks, models, data_prep, difflm. Never deploy/ (ops tooling) or benchmarks/.
"""
