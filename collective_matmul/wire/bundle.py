"""Bundles: tuned configs exported to one JSON file, for training code without a server."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, computed_field, model_validator

from collective_matmul.planning.decomposition import Decomposition, OpConfigs
from collective_matmul.planning.models import MAX_ROLES, SLOTS, ModelName, Role
from collective_matmul.planning.problem import Hardware, Problem, Software, Version, log_distance
from collective_matmul.planning.text import label, message
from collective_matmul.wire import bounds as _bounds
from collective_matmul.wire.bounds import OverlapVerdict

log = logging.getLogger(__name__)
BUNDLE_FORMAT = "cmtune.bundle"
BUNDLE_VERSION = 4  # 2 adds per-model, per-role overrides; 3 the software stack of each; 4 each config's compiled
# overlap verdict and memory; versions 1 to 3 still load


Timestamp = label(64)  # ISO 8601, as `utc_now` writes it
Count = Annotated[int, Field(ge=0, le=(1 << 31) - 1)]  # an integer column
Reason = message(2000)  # role_overrides.reason
DERIVED = frozenset({"bound_s", "hidden_fraction", "reason"})  # TunedConfig's computed fields (read back: ignored)


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class TunedConfig(BaseModel):
    """The best decomposition measured for one (problem, hardware), with its evidence."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    problem: Problem
    hardware: Hardware = Field(description="identity only: versions are in jax_version/jaxlib_version")
    decomposition: Decomposition
    time_s: float = Field(gt=0, allow_inf_nan=False,
                          description="median time of the decomposition in the confirmation round")
    baseline_s: float = Field(gt=0, allow_inf_nan=False, description="median time of the baseline in the same round")
    speedup: float = Field(gt=0, allow_inf_nan=False, description="median paired baseline/candidate ratio")
    speedup_iqr: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    trials: Count = 0
    invalid: Count = 0
    failed: Count = 0
    space_size: Count = 0
    jax_version: Version = Field(default="", description="software.jax (kept for bundles before version 3)")
    jaxlib_version: Version = Field(default="", description="software.jaxlib (kept for bundles before version 3)")
    tuned_at: Timestamp = Field(default_factory=utc_now)
    compute_s: float | None = Field(default=None, gt=0, allow_inf_nan=False,
                                    description="the local matmul alone (median of the bounds rounds; None: not "
                                                "measured)")
    communication_s: float | None = Field(default=None, gt=0, allow_inf_nan=False,
                                          description="the collective alone, the same bytes (median of the bounds "
                                                      "rounds)")
    bounds_baseline_s: float | None = Field(default=None, gt=0, allow_inf_nan=False,
                                            description="the baseline timed in the bounds rounds (the hidden "
                                                        "fraction compares each time with its own round's baseline)")
    software: Software = Field(default_factory=Software,
                               description="the stack that measured it, part of its key (an entry of a version 1 "
                                           "or 2 bundle: its jax_version and jaxlib_version, no flags)")
    overlap: OverlapVerdict | None = Field(default=None, description="its compiled schedule's verdict "
                                           "(collective_matmul.programs.schedule): does a product run while each of "
                                           "its permutes is in flight (None: not recorded, a bundle before version 4)")
    memory_bytes: int | None = Field(default=None, ge=0, le=1 << 60,
                                     description="its compiled program's memory per device (None: not recorded)")

    @model_validator(mode="before")
    @classmethod
    def _derived_are_recomputed(cls, data):
        """The derived values (`DERIVED`) a dump carries are computed again, never read back."""
        if isinstance(data, dict) and DERIVED & data.keys():
            data = {k: v for k, v in data.items() if k not in DERIVED}
        return data

    @model_validator(mode="before")
    @classmethod
    def _stack(cls, data: Any) -> Any:
        """``software`` from ``jax_version``/``jaxlib_version`` where a record has none (bundles before version 3,
        as migration 0008 does for stored configs); where it has one, those two from it where they are empty."""
        if not isinstance(data, dict):
            return data
        stack = data.get("software")
        if stack is None:
            return {**data, "software": {"jax": data.get("jax_version") or "",
                                         "jaxlib": data.get("jaxlib_version") or ""}}
        if isinstance(stack, dict):
            stack = {name: stack.get(name, "") for name in ("jax", "jaxlib")}
        elif isinstance(stack, Software):
            stack = {"jax": stack.jax, "jaxlib": stack.jaxlib}
        else:
            return data  # the field's own validation says what is wrong
        return {**data, "jax_version": data.get("jax_version") or stack["jax"],
                "jaxlib_version": data.get("jaxlib_version") or stack["jaxlib"]}

    @model_validator(mode="after")
    def _fits(self) -> TunedConfig:
        try:
            self.problem.check(self.decomposition)
        except ValueError as exc:
            raise ValueError(f"tuned config of {self.problem.key}: {exc}") from None
        for name in ("jax", "jaxlib"):
            recorded, stack = getattr(self, f"{name}_version"), getattr(self.software, name)
            if recorded != stack:
                raise ValueError(f"tuned config of {self.problem.key}: {name}_version={recorded!r} is not its "
                                 f"software's {name}={stack!r}; give one of them, or the same in both")
        given = [self.compute_s is not None, self.communication_s is not None, self.bounds_baseline_s is not None]
        if any(given) and not all(given):
            raise ValueError(f"tuned config of {self.problem.key}: give all three bounds (compute_s, communication_s, "
                             "bounds_baseline_s) or none")
        return self

    @property
    def bounds(self) -> _bounds.Bounds | None:
        """The bounds measured with this config's confirmation round (None: not measured)."""
        if self.compute_s is None:
            return None
        return _bounds.Bounds(self.compute_s, self.communication_s, self.bounds_baseline_s)

    @property
    def ring(self) -> bool:
        return self.decomposition.method == "ring"

    @computed_field(description="max(compute_s, communication_s): the best overlap can do (None: not measured)")
    @property
    def bound_s(self) -> float | None:
        return self.bounds.bound_s if self.bounds is not None else None

    @computed_field(description="(baseline − tuned) / (baseline − bound), each against its own round's baseline "
                                "(collective_matmul.wire.bounds); None: nothing to hide or no bounds; 0: the baseline "
                                "won")
    @property
    def hidden_fraction(self) -> float | None:
        return _bounds.hidden_fraction(self.bounds, self.time_s / self.baseline_s, ring=self.ring)

    @computed_field(description="in words: how much a winning ring hid and how far it is from the bound, or why no "
                                "ring won")
    @property
    def reason(self) -> str:
        return _bounds.verdict(self.bounds, self.time_s / self.baseline_s, ring=self.ring)

    @property
    def key(self) -> tuple[str, str, str]:
        """(problem, hardware, software stack): one config per stack."""
        return self.problem.key, self.hardware.key, self.software.key

    def measured_on(self, software: Software) -> TunedConfig:
        """This config recorded as measured on ``software`` (its version fields follow)."""
        return self.model_copy(update={"software": software, "jax_version": software.jax,
                                       "jaxlib_version": software.jaxlib})


def nearest(problem: Problem, configs: Iterable[TunedConfig]) -> TunedConfig | None:
    """The tuned config of the same collective, dtype and ring size whose (m, k, n) is closest to
    ``problem``'s in log-distance and whose decomposition is valid for it (``configs`` of one
    hardware); ties go to the smaller key."""
    same = [c for c in configs
            if (c.problem.collective, c.problem.dtype, c.problem.axis_size)
            == (problem.collective, problem.dtype, problem.axis_size) and problem.accepts(c.decomposition)]
    if not same:
        return None
    return min(same, key=lambda c: (log_distance(problem, c.problem), c.problem.key))


class RoleOverride(BaseModel):
    """What one role of one model runs on one hardware, decided by measuring the whole step.

    Tuned configs are keyed by (problem, hardware), and one problem can serve several roles; when
    the step measurement finds a role faster set back to the baseline (or with its weight
    gradient fused), that holds for this model only, and this record says so and why.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelName = Field(description="the model's name (TransformerBlock.name, or the name a user's step "
                                         "was verified under)")
    role: Role = Field(description="the reference block's role, or a user's projection "
                                   "(collective_matmul.programs.roles)")
    hardware: Hardware = Field(description="identity only")
    configs: OpConfigs
    reason: Reason
    step_speedup: float | None = Field(default=None, gt=0, allow_inf_nan=False,
                                       description="the step with this choice, over the step as written "
                                                   "(median of paired runs)")
    problems: dict[Literal["forward", "grad_input", "grad_weight"], Problem] | None = Field(
        default=None, description="the role's three problems (a user's step; the block's are derived from its "
                                  "shapes): each config is checked against its own")
    software: Software | None = Field(
        default=None, description="the stack of the step measurement that decided it (None: not recorded, before "
                                  "bundle version 3); an override of another stack is still applied, and reported so")

    @model_validator(mode="after")
    def _configs_fit(self) -> RoleOverride:
        if self.problems is not None:
            if set(self.problems) != set(SLOTS):
                raise ValueError(f"problems must name the three slots {list(SLOTS)}, got {sorted(self.problems)}")
            for slot in SLOTS:
                try:
                    self.problems[slot].check(getattr(self.configs, slot))
                except ValueError as exc:
                    raise ValueError(f"override of {self.role}: {slot}: {exc}") from None
        return self

    @property
    def key(self) -> tuple[str, str, str]:
        return self.model, self.role, self.hardware.key


class Bundle(BaseModel):
    """A versioned list of tuned configs and role overrides; the format is in docs/tuning.md ("Bundle format")."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["cmtune.bundle"] = BUNDLE_FORMAT
    version: Literal[1, 2, 3, 4] = BUNDLE_VERSION
    created_at: Timestamp = Field(default_factory=utc_now)
    configs: list[TunedConfig] = Field(default_factory=list, max_length=100_000)
    overrides: list[RoleOverride] = Field(default_factory=list, max_length=100 * MAX_ROLES)

    def add(self, config: TunedConfig) -> None:
        """Add or replace the entry for the same (problem, hardware, software stack): another stack's stays."""
        self.configs = [c for c in self.configs if c.key != config.key] + [config]

    def add_override(self, override: RoleOverride) -> None:
        """Add or replace the override for the same (model, role, hardware)."""
        self.overrides = [o for o in self.overrides if o.key != override.key] + [override]

    def lookup(self, problem: Problem, hardware: Hardware, software: Software | None = None) -> TunedConfig | None:
        """The entry of (problem, hardware) measured on ``software``; without one, the newest of any stack."""
        found = [c for c in self.configs if c.key[:2] == (problem.key, hardware.key)
                 and (software is None or c.software.key == software.key)]
        return max(reversed(found), key=lambda c: c.tuned_at) if found else None

    def override(self, model: str, role: str, hardware: Hardware) -> RoleOverride | None:
        key = (model, role, hardware.identity().key)
        return next((o for o in self.overrides if o.key == key), None)

    def save(self, path: str | Path) -> None:
        """Write the file (always the current version: an old one gains the new, empty fields)."""
        Path(path).write_text(self.model_copy(update={"version": BUNDLE_VERSION}).model_dump_json(indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Bundle:
        """Read a bundle file.

        Raises:
            ValueError: if the file is not a cmtune bundle of a supported version.
        """
        text = Path(path).read_text()
        try:
            return cls.model_validate_json(text)
        except ValidationError as exc:
            raise BundleError(path, exc) from None


class BundleError(ValueError):
    """A file that is not a bundle of a supported version: one line that says so (the path, what was expected,
    the first thing wrong); every validation error in ``details`` (logged at DEBUG, `cmtune --verbose`)."""

    def __init__(self, path: str | Path, error: ValidationError):
        self.path, self.details = str(path), str(error)
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the file"
        problem = first["msg"] if first["type"] == "json_invalid" else f"{where}: {first['msg']}"
        more = error.error_count() - 1
        super().__init__(f"{path}: not a cmtune bundle ({problem}{f'; {more} more' if more else ''}); expected "
                         f"the JSON that cmtune tune --out writes, format {BUNDLE_FORMAT!r}, version 1 to "
                         f"{BUNDLE_VERSION}")
        log.debug("%s: %s", path, self.details)
