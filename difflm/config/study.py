"""A data-constrained study: a YAML grid of families x unique-token budgets x epochs x model sizes.

Each point of the grid is one run of the flagship pipeline: the preset, the study's `base` overrides, its family's
overrides, then `data.unique_tokens`, `train.epochs` and `model.preset` set by the grid. Expanding a spec checks
every point's config, so a bad family or a conflicting override is one line before anything runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from difflm.config.base import ConfigError
from difflm.config.loading import load_config, parse_override, read_yaml
from difflm.config.pipeline import PipelineConfig

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a folder and an MLflow run name: no path, no shell
GRID_KEYS = {"data.unique_tokens": "unique_tokens", "train.epochs": "epochs", "model.preset": "sizes"}


def _check_name(name: str, what: str) -> str:
    if not NAME.match(name):
        raise ValueError(f"{what} {name!r} must be letters, digits, '_', '.', '-' (it names folders and runs)")
    return name


def _preset_size() -> list[str | None]:
    return [None]  # the preset's own model


def _lengths(v: list[float], where: str) -> list[float]:
    if not v or any(e <= 0 for e in v) or len(set(v)) != len(v):
        raise ValueError(f"{where}must be distinct positive numbers of epochs")
    return v


class Family(BaseModel):
    """A family of the grid: its overrides, and the most epochs it trains (the literature stops AR arms at about
    50 epochs, where their loss has turned back up, and trains diffusion to 800)."""

    model_config = ConfigDict(extra="forbid")

    overrides: list[str] = Field(default_factory=list, description="The family's overrides.")
    max_epochs: float | None = Field(None, gt=0, description="Its points stop at this many epochs (none: all).")

    @model_validator(mode="before")
    @classmethod
    def _a_list_is_its_overrides(cls, v: Any) -> Any:
        return {"overrides": v} if isinstance(v, list) else v


class StudySpec(BaseModel):
    """What a study file holds (`difflm study SPEC`)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("study", description="The study's name: its MLflow parent run and output folder.")
    preset: str = Field("tiny-cpu", description="The preset every point starts from (a name in configs/ or a path).")
    base: list[str] = Field(default_factory=list, description="Overrides shared by every point.")
    families: dict[str, Family] = Field(
        min_length=1,
        description="Family name -> its overrides (e.g. ar: [diffusion.model_running_mode=ar]), or "
        "{overrides: [...], max_epochs: N}.",
    )
    unique_tokens: list[int] = Field(min_length=1, description="The unique-token budgets (data.unique_tokens).")
    epochs: list[float] | dict[int, list[float]] = Field(
        description="The lengths in epochs over the budget (train.epochs): a list for every budget, or a list per "
        "budget ({budget: [epochs]}: a control of many unique tokens at 1-2 epochs beside a small budget repeated)."
    )
    sizes: list[str | None] = Field(
        default_factory=_preset_size, min_length=1, description="Model presets (model.preset); null: the preset's."
    )
    parallel: int = Field(1, ge=1, description="How many points train at once.")
    output: str | None = Field(None, description="The study's output folder (default: <workdir>/studies/<name>).")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check_name(v, "name")

    @field_validator("families")
    @classmethod
    def _families(cls, v: dict[str, Family]) -> dict[str, Family]:
        for fam, family in v.items():
            _check_name(fam, "family")
            _no_grid_keys(family.overrides, f"family {fam}")
        return v

    @field_validator("base")
    @classmethod
    def _base(cls, v: list[str]) -> list[str]:
        _no_grid_keys(v, "base")
        return v

    @field_validator("unique_tokens")
    @classmethod
    def _budgets(cls, v: list[int]) -> list[int]:
        if any(n < 1 for n in v) or len(set(v)) != len(v):
            raise ValueError("must be distinct positive token counts")
        return v

    @field_validator("epochs")
    @classmethod
    def _epochs(cls, v: list[float] | dict[int, list[float]]) -> list[float] | dict[int, list[float]]:
        if isinstance(v, list):
            return _lengths(v, "")
        for budget, lengths in v.items():
            _lengths(lengths, f"{budget}: ")
        return v

    @model_validator(mode="after")
    def _every_budget_has_lengths(self) -> StudySpec:
        if isinstance(self.epochs, dict) and set(self.epochs) != set(self.unique_tokens):
            raise ValueError(
                f"epochs: a list per budget must name each of unique_tokens {self.unique_tokens} once (it names "
                f"{sorted(self.epochs)}); or give one list for every budget"
            )
        for name, family in self.families.items():
            if family.max_epochs is not None and not any(
                e <= family.max_epochs for b in self.unique_tokens for e in self.lengths(b)
            ):
                raise ValueError(f"families.{name}.max_epochs={family.max_epochs:g} is below every epochs of the grid")
        return self

    def lengths(self, budget: int) -> list[float]:
        """The epochs the grid trains `budget` for."""
        return self.epochs[budget] if isinstance(self.epochs, dict) else self.epochs

    def points(self) -> list[Point]:
        """Every point of the grid, each with its config checked (ConfigError: one line naming the point)."""
        out = []
        for size in self.sizes:
            for fam, family in self.families.items():
                for budget in self.unique_tokens:
                    for epochs in self.lengths(budget):
                        if family.max_epochs is not None and epochs > family.max_epochs:
                            continue
                        grid = [f"data.unique_tokens={budget}", f"train.epochs={epochs:g}"]
                        grid += [f"model.preset={size}"] if size else []
                        point = Point(fam, budget, epochs, size, [*self.base, *family.overrides, *grid])
                        try:
                            point.cfg = load_config(self.preset, point.overrides)
                        except ConfigError as err:
                            detail = " ".join(str(err).split())
                            raise ConfigError(f"study {self.name}, point {point.label}: {detail}") from None
                        out.append(point)
        _same_heldout(self.name, out)
        return out

    def output_dir(self, cfg: PipelineConfig) -> Path:
        return Path(self.output) if self.output else Path(cfg.workdir) / "studies" / self.name


def _heldout(cfg: PipelineConfig) -> dict[str, Any]:
    """What decides the held-out tokens a point is scored on and how: the data but its training subset, the
    tokenizer, the evaluation settings and the window length."""
    data = cfg.data.model_dump(mode="json", exclude={"unique_tokens", "subset_seed"})
    return {
        "data": data,
        "tokenizer": cfg.tokenizer.model_dump(mode="json"),
        "eval": cfg.eval.model_dump(mode="json"),
        "train.seq_length": cfg.train.seq_length,
    }


def _same_heldout(name: str, points: list[Point]) -> None:
    """Every point is scored on the same held-out tokens, the same way: else the comparison means nothing."""
    first = _heldout(points[0].cfg)
    for point in points[1:]:
        other = _heldout(point.cfg)
        differ = [k for k in first if first[k] != other[k]]
        if differ:
            raise ConfigError(
                f"study {name}: points {points[0].label} and {point.label} differ in {', '.join(differ)}, so they "
                "would be scored on other held-out tokens or otherwise; set those in base, not in a family or size"
            )


def _no_grid_keys(overrides: list[str], where: str) -> None:
    """The grid sets the budget, the epochs and the size: an override of them in `where` would be lost."""
    for text in overrides:
        try:
            keys, _ = parse_override(text)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        key = ".".join(keys)
        if key in GRID_KEYS or key == "train.train_iters":
            raise ValueError(f"{where} sets {key}, which the grid sets: list it under {GRID_KEYS.get(key, 'epochs')}")


@dataclass
class Point:
    """One run of the grid."""

    family: str
    unique_tokens: int
    epochs: float
    size: str | None
    overrides: list[str]
    cfg: Any = field(default=None, repr=False)  # its PipelineConfig, set by StudySpec.points

    @property
    def label(self) -> str:
        size = f"-{self.size}" if self.size else ""
        return f"{self.family}{size}-u{self.unique_tokens}-e{self.epochs:g}"


def load_study(path: str | Path) -> StudySpec:
    """A study file, validated; a mistake is one line: the file, the field and what to do."""
    data = read_yaml(Path(path))
    try:
        return StudySpec.model_validate(data)
    except ValidationError as err:
        e = err.errors()[0]
        loc = ".".join(str(p) for p in e["loc"])  # empty: a check of several fields, whose message names them
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"unknown field (fields: {', '.join(StudySpec.model_fields)})"
        elif e["type"] == "missing":
            msg = f"missing: {StudySpec.model_fields[loc].description}" if loc in StudySpec.model_fields else msg
        more = f" (and {len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
        raise ConfigError(f"{path}: {f'{loc}: ' if loc else ''}{msg}{more}") from None


def study_spec(path: str | Path, preset: str | None = None, overrides: list[str] | None = None) -> StudySpec:
    """`load_study`, with another `preset` and more `base` overrides (the command line's)."""
    spec = load_study(path)
    update: dict[str, Any] = {"base": [*spec.base, *(overrides or [])]}
    if preset:
        update["preset"] = preset
    return StudySpec.model_validate({**spec.model_dump(), **update})
