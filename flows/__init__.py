"""Prefect flows: thin wiring of `tasks` (pretrain-difflm, data-prep), tracked in MLflow.

May import everything below: tasks, models, data_prep, difflm.
"""
