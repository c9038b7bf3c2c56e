"""The conversations of one split of prepared instruction data, as conversations (not tokens): what an evaluation
asks a model (the turns before the last answer, `ChatFormat.prompt_ids`) and compares its answer with.

Data prep assigns a conversation to a split by a hash of its text (difflm.data_prep.split), so the split is found
again by reading the sources the manifest records with the same readers and settings and hashing each
conversation: no copy of the data is kept beside the shards, and the held-out items of the shipped tasks
(`demo:instructions`) or of a user's own data come out the same way.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from datatrove.utils.logging import logger

from difflm.config import DataConfig
from difflm.data_prep.errors import DataPrepError
from difflm.data_prep.instructions import make_instruction_reader
from difflm.data_prep.split import split_of
from difflm.manifest import DataManifest


def split_conversations(manifest: DataManifest, split: str = "valid") -> Iterator[list[dict[str, str]]]:
    """Each conversation of `split` (a list of {role, content}), in input order, source by source."""
    if manifest.kind != "instruction":
        raise DataPrepError(f"the data at {manifest.dir} is {manifest.kind} data, not instruction data")
    data = DataConfig.model_validate(manifest.config["data"])
    for src in manifest.sources:
        path = Path(src["path"])
        if not path.exists():
            raise DataPrepError(f"{path} (source {src['name']!r} of {manifest.dir}) is gone: its split cannot be read")
        reader = make_instruction_reader(path, src["format"], src["name"], data.instruction_keys)
        reader.quiet, reader.normalization = True, data.unicode_normalization
        reader.limit = data.max_documents or -1
        logger.disable("difflm.data_prep.tolerant")  # the per-file lines belong to the prep's task logs
        try:
            for doc in reader.run(None, rank=0, world_size=1):
                if split_of(doc.text, data.valid_fraction, data.split_seed, data.test_fraction) == split:
                    yield json.loads(doc.text)
        finally:
            logger.enable("difflm.data_prep.tolerant")
