"""The top floor: Prefect flows, thin wiring of `tasks` (pretrain-difflm, data-prep, evaluate, convert-checkpoint,
evaluate-latest), tracked in MLflow; and the command line `difflm` (`cli.py`), which dispatches to them and to the
plain stages.

May import everything below: tasks, models, data_prep, difflm. Never deploy/ (ops tooling) or benchmarks/.
"""

import warnings

# megatron warns at import, about ten times, that Apex and Transformer Engine are absent; without them the kernels
# are chosen and logged once (models/megatron/kernels.py), so the warnings are not news. `difflm` hides them in its
# main(); a served deployment's flow runs never call it (Prefect's runner loads difflm.flows.<flow> in a process of
# its own), so they are hidden here, where every flow's module is imported from, before megatron is
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*")
