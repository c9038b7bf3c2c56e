"""Reading a config: YAML presets, `key.sub=value` overrides, validation with readable errors, saving."""

from __future__ import annotations

import difflib
import reprlib
import types
import typing
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)

from difflm.config.base import ConfigError
from difflm.config.diffusion import DiffusionConfig, diffusion_model, modes
from difflm.config.evaluation import FLAT_SAMPLER_FIELDS, nest_sampler_fields
from difflm.config.pipeline import PipelineConfig
from difflm.config.train import MOVED, TrainConfig, nest_train_fields, new_train_key

CONFIG_DIR = (
    Path(__file__).parents[1] / "configs"
)  # difflm/configs: a link to the checkout's configs/, a folder once installed


# A config, preset or study spec has a few hundred values; aliases (`*name`) may not make it expand past this: a
# 314-byte "billion laughs" file of nested aliases is 387 million strings once validated, echoed or printed.
MAX_YAML_VALUES = 100_000
_ECHO = reprlib.Repr()  # what an error shows of a value the user gave: enough to recognise it, never all of it
_ECHO.maxstring, _ECHO.maxother, _ECHO.maxlist, _ECHO.maxdict, _ECHO.maxlevel = 120, 120, 8, 8, 3


def short_repr(value: Any, limit: int = 300) -> str:
    """`repr(value)` as an error line echoes it: long strings, lists and nested values shortened (`...`)."""
    text = _ECHO.repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


class BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a document whose aliases expand past MAX_YAML_VALUES values, or refer to
    themselves, before anything is built from it (counted on the composed nodes: an alias is one node shared by
    every place that names it, so the count is of what it expands to, each node counted once per use)."""

    def compose_document(self):
        node = super().compose_document()
        if node is not None:
            _count_values(node, {}, set())
        return node


def _count_values(node: yaml.Node, counted: dict[int, int], open_: set[int]) -> int:
    key = id(node)
    if key in counted:
        return counted[key]
    if key in open_:
        raise yaml.composer.ComposerError(
            None,
            None,
            "an alias refers to the value that contains it (a recursive value): write it out",
            node.start_mark,
        )
    open_.add(key)
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [part for pair in node.value for part in pair]
    else:
        children = []
    total = 1 + sum(_count_values(child, counted, open_) for child in children)
    open_.discard(key)
    if total > MAX_YAML_VALUES:
        raise yaml.composer.ComposerError(
            None,
            None,
            f"its aliases expand to more than {MAX_YAML_VALUES} values (an alias bomb?): a configuration has a few "
            "hundred; write the values out",
            node.start_mark,
        )
    counted[key] = total
    return total


def safe_load(text: str) -> Any:
    """yaml.safe_load with aliases bounded (`BoundedLoader`): for every YAML a user or another user can hand us."""
    return yaml.load(text, Loader=BoundedLoader)  # a SafeLoader


def _format_validation_error(err: ValidationError) -> str:
    lines = ["invalid configuration:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            fields = _fields_at(e["loc"][:-1])
            close = difflib.get_close_matches(str(e["loc"][-1]), list(fields), n=1, cutoff=0.6)
            hint = f"did you mean {'.'.join([*map(str, e['loc'][:-1]), fields[close[0]]])}? " if close else ""
            msg = f"unknown field ({hint}`difflm config show` lists every field)"
        got = e.get("input")
        if e["type"] == "value_error":  # a check of ours: its message is the line, less pydantic's prefix
            msg = msg.removeprefix("Value error, ")
            if msg.startswith(f"{loc}.") and " " in msg:  # it names the field within the section: that is the line
                lines.append(f"  {msg}")
                continue
        lines.append(f"  {loc}: {msg}" + ("" if isinstance(got, dict) else f" (got {short_repr(got)})"))
    return "\n".join(lines)


def _fields_at(loc: tuple) -> dict[str, str]:
    """The field names of the config section at `loc` (for "did you mean"), each with the key to suggest; {} where
    loc is not a section. The `diffusion` section offers the settings of every mode, `train` the new keys of its flat
    spelling of before (`lr` -> `optimizer.lr`)."""
    model: type[BaseModel] = PipelineConfig
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return {}
        ann = field.annotation
        if isinstance(ann, types.UnionType) or typing.get_origin(ann) is typing.Union:  # X | None
            ann = next((a for a in typing.get_args(ann) if a is not type(None)), None)
        if typing.get_origin(ann) is Annotated:  # SerializeAsAny[X]
            ann = typing.get_args(ann)[0]
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return {}
        model = ann
    if model is DiffusionConfig:
        return {name: name for mode in modes().MODES for name in diffusion_model(mode).model_fields}
    if model is TrainConfig:
        return {**{old: f"{section}.{old}" for old, section in MOVED.items()}, **{n: n for n in model.model_fields}}
    return {name: name for name in model.model_fields}


def read_yaml(path: Path) -> dict[str, Any]:
    """A preset or a run's config.yaml as a mapping; a YAML mistake is one line, `file:line:column: problem`."""
    try:
        data = safe_load(Path(path).read_text())
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        start = err.context_mark if err.context and err.problem else None
        context = f", {err.context} at {start.line + 1}:{start.column + 1}" if start else ""
        raise ConfigError(f"{where}: {err.problem or err.context}{context}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot be read ({err})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: a preset is a mapping of sections (model:, train:, data:, ...), not a {type(data).__name__}"
        )
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (['a','b'], parsed value); values parse as YAML scalars (3, 1e-3, true, null, [a, b])."""
    if "=" not in text:
        raise ConfigError(f"override {short_repr(text)} is not of the form key.sub=value")
    key, _, raw = text.partition("=")
    keys = [k for k in key.strip().split(".") if k]
    if not keys:
        raise ConfigError(f"override {short_repr(text)} has an empty key")
    try:
        return keys, safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        problem = str(err).splitlines()[0]
        raise ConfigError(
            f"override {short_repr(text)}: the value is not valid YAML ({problem}). Quote the whole override for the shell, "
            f'e.g. "data.sources=[{{path: a.jsonl}}, b/]"'
        ) from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    if isinstance(data.get("eval"), dict):  # written in the spelling of before (a run's own config.yaml)
        try:
            data["eval"] = nest_sampler_fields(data["eval"])
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if isinstance(data.get("train"), dict):  # the flat train section of before (a run's own config.yaml)
        try:
            data["train"] = nest_train_fields(data["train"])
        except ValueError as err:
            raise ConfigError(str(err)) from None
    lengths = set()  # which of the run's two lengths the overrides give
    for text in overrides:
        keys, value = parse_override(text)
        keys = new_train_key(keys)  # train.lr=... -> train.optimizer.lr=...
        if keys in (["train", "train_iters"], ["train", "epochs"]) and value is not None:
            lengths.add(keys[1])
        if len(keys) == 2 and keys[0] == "eval" and keys[1] in FLAT_SAMPLER_FIELDS:  # eval.temperature=...
            keys = ["eval", "sampler", FLAT_SAMPLER_FIELDS[keys[1]]]
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {short_repr(text)}: {k!r} is not a section")
        node[keys[-1]] = value
    if len(lengths) == 1 and isinstance(data.get("train"), dict):  # the command line's length replaces the preset's
        data["train"].pop(({"train_iters", "epochs"} - lengths).pop(), None)
    return data


def resolve_preset(preset: str) -> Path:
    """A preset name in configs/ or a path to a YAML file."""
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    candidate = CONFIG_DIR / f"{preset}.yaml"
    if candidate.exists():
        return candidate
    known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError(f"no preset or YAML file {preset!r}; presets: {', '.join(known)}")


def load_config(preset: str | None = "tiny-cpu", overrides: list[str] | None = None) -> PipelineConfig:
    """Load a preset (name or YAML path), apply overrides, validate. Raises ConfigError before any work."""
    data: dict[str, Any] = {}
    if preset:
        data = read_yaml(resolve_preset(preset))
    data = apply_overrides(data, overrides or [])
    return validate(data)


def validate(data: dict[str, Any]) -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def save_config(cfg: PipelineConfig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path
