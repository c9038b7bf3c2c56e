"""Ground floor: the typed config (`config`), the exception hierarchy (`errors`), the layout of a run directory
(`rundir`), and MLflow tracking, registry and plots (`tracking/`).

Imports no other package of the project (`flows`, `tasks`, `models`, `data_prep` stand on it; tests/unit/test_layout.py
checks the arrows). The command line lives on the top floor, in `flows/cli.py`.
"""

from __future__ import annotations

import os

# Local state and no phoning home: the one list. The CLI and tests/conftest.py set it in the process, the
# production stack (deploy/stack.py) in each service; the Dockerfile's ENV repeats it (tests/integration/test_production_stack.py
# checks that the two agree).
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "TOKENIZERS_PARALLELISM": "false",
}


def set_offline_env() -> None:
    """Set OFFLINE_ENV in this process where not set already (set it before Prefect/MLflow/transformers load)."""
    for key, val in OFFLINE_ENV.items():
        os.environ.setdefault(key, val)


def cache_dir() -> str:
    """The cache of what is fetched once and reused by every run (the demo corpus, the example pretrained model):
    $DIFFLM_CACHE, else $XDG_CACHE_HOME/difflm-pipeline, else ~/.cache/difflm-pipeline."""
    return os.environ.get("DIFFLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "difflm-pipeline"
    )
