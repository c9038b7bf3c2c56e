"""The config's building blocks: the section base class, run identity declared per field, the error type."""

from __future__ import annotations

import warnings
from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.config import JsonDict
from pydantic.fields import FieldInfo

from difflm.errors import UserError

# Run identity, declared per field. Each stage's output directory is named by a hash of the sections it reads
# (`PipelineConfig.stage_hash`): every field is part of that name unless it is marked OPERATIONAL, i.e. it
# changes how a run is carried out (who launches it, how it reacts to faults) but not what it computes, so
# any setting of it resumes and reuses the same directory. A new field forks every existing run directory
# unless it is OPERATIONAL or IF_SET: tests/unit/difflm/test_config.py lists the identity fields, so adding one is a decision.
# IF_SET marks an identity field added later whose default computes what runs made before it computed: it joins
# the name only when set to another value, so those runs keep their directories.
# FLATTEN marks a sub-section that groups fields its parent held before: their identity is the parent's, under
# their own names (`train.optimizer.lr` names the run as `train.lr` did).
OPERATIONAL: JsonDict = {"identity": False}
IF_SET: JsonDict = {"identity": "if_set"}
FLATTEN: JsonDict = {"identity": "flatten"}


def is_identity(field: FieldInfo) -> bool:
    """Whether a field is part of the name of its stage's output directory (see OPERATIONAL)."""
    extra = field.json_schema_extra
    return not (isinstance(extra, dict) and extra.get("identity") is False)


class _Section(BaseModel):
    # extra="forbid": a misspelt key is an error, not a silently ignored setting.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _identity(section: BaseModel) -> dict[str, Any]:
    """`section` as JSON (`model_dump(mode="json")`), without the OPERATIONAL fields of it and of every section
    nested in it."""

    def prune(value: Any, dumped: Any) -> Any:
        if isinstance(value, BaseModel):
            out: dict[str, Any] = {}
            for name, field in type(value).model_fields.items():
                if not is_identity(field) or (_if_set(field) and getattr(value, name) == field.default):
                    continue
                pruned = prune(getattr(value, name), dumped[name])
                if is_flattened(field):
                    out.update(pruned)
                else:
                    out[field.serialization_alias or name] = pruned
            return out
        if isinstance(value, (list, tuple)):
            return [prune(v, d) for v, d in zip(value, dumped)]
        return dumped

    return prune(section, section.model_dump(mode="json"))


def _mark(field: FieldInfo) -> Any:
    extra = field.json_schema_extra
    return extra.get("identity") if isinstance(extra, dict) else None


def _if_set(field: FieldInfo) -> bool:
    return _mark(field) == "if_set"


def is_flattened(field: FieldInfo) -> bool:
    """Whether a sub-section's identity fields count as its parent's (see FLATTEN)."""
    return _mark(field) == "flatten"


class ConfigError(UserError, ValueError):
    """An invalid configuration, with a message that names the field and what it accepts."""

    exit_code = 2  # a usage error, as argparse's


def deprecated(old: str, new: str) -> None:
    """An old spelling of a setting, read as its new one for a release."""
    warnings.warn(f"{old} is deprecated: use {new}", DeprecationWarning, stacklevel=4)
