"""A datatrove step the tests add to data prep (from the test side: the production pipeline has no test hook) to
hold one task mid-way, so that it can be killed there: after reading, sharding and writing some of its documents.

`Gate(gate, rank, after)`: while the file `gate` exists, task `rank` stops before its document number `after`
(the earlier ones are already handed to the writer) and touches `gate` + ".reached"; it goes on once `gate` is
gone. Every other task, and every task once `gate` is gone, passes its documents through unchanged. A Slurm task
unpickles it by module name: `tests/support/` must be on the job's PYTHONPATH.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep


class Gate(PipelineStep):
    name = "gate"
    type = "🧪 - TEST"

    def __init__(self, gate: str, rank: int, after: int):
        super().__init__()
        self.gate, self.rank, self.after = gate, rank, after

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        for i, doc in enumerate(data):
            if rank == self.rank and i == self.after and os.path.exists(self.gate):
                Path(self.gate + ".reached").touch()
                while os.path.exists(self.gate):
                    time.sleep(0.1)
            yield doc
