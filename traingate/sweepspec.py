"""The `sweep:` section of a RunSpec. Pydantic only: imported by every training process, so no optuna here.

A sweep separates *what to try next* (``sampler``) from *how much budget each trial
gets* (``scheduler``). Search-space keys are dotted paths into the RunSpec::

    sweep:
      space:
        optim.lr: {type: float, low: 1.0e-4, high: 0.1, log: true}
        recipe.params.channels: {type: categorical, choices: [4, 8, 16]}
        optim.warmup_steps: {type: int, low: 0, high: 20, when: {optim.schedule: cosine}}
      objectives: [{metric: val_accuracy, direction: maximize}]
      sampler: tpe
      scheduler: {name: asha, report_every: 10}
      n_trials: 20
      max_concurrent: 2
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from traingate.specbase import MAX_SECONDS, MAX_SEED, SpecModel, check_name

SAMPLERS = ("grid", "random", "tpe", "cmaes", "nsga2")
SCHEDULERS = ("fifo", "median", "asha", "hyperband", "pbt")
# Optuna's GridSampler lists every point in memory (a tuple each) and a sweep never runs more than this.
MAX_GRID_POINTS = 1_000_000
# More trials, or trials at once, than any study holds: a typo (an extra 000), refused rather than queued.
MAX_TRIALS = 100_000
# Optuna stores categorical choices as JSON scalars.
CHOICE_TYPES = (type(None), bool, int, float, str)


_M = SpecModel


class ParamSpec(_M):
    type: Literal["float", "int", "categorical"]
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = Field(default=None, gt=0)
    choices: list[Any] | None = None
    # Conditional parameter: sampled only when each named (earlier) parameter has the given
    # value, or one of the given values when a list is given.
    when: dict[str, Any] | None = None

    @field_validator("choices")
    @classmethod
    def _storable_choices(cls, choices: list[Any] | None) -> list[Any] | None:
        for i, c in enumerate(choices or []):
            if not isinstance(c, CHOICE_TYPES):
                raise ValueError(
                    f"choice {i} ({c!r}) is a {type(c).__name__}; Optuna stores only null, true/false, "
                    "numbers or strings as choices: list scalars, one per choice"
                )
        seen: list[Any] = []
        for c in choices or []:
            # 1 == 1.0 == True in Python, so compare type and value.
            if any(type(c) is type(d) and c == d for d in seen):
                raise ValueError(f"choice {c!r} is listed twice; list each choice once")
            seen.append(c)
        return choices

    @model_validator(mode="after")
    def _consistent(self) -> ParamSpec:
        if self.type == "categorical":
            if not self.choices:
                raise ValueError("a categorical parameter needs `choices: [...]` (at least one)")
            if self.low is not None or self.high is not None or self.step is not None or self.log:
                raise ValueError("a categorical parameter takes `choices`, not low/high/step/log; remove them")
            return self
        if self.choices is not None:
            raise ValueError(f"a {self.type} parameter takes low/high, not choices; use type: categorical")
        if self.low is None or self.high is None:
            raise ValueError(f"a {self.type} parameter needs both `low` and `high`")
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high}); swap or widen them")
        if self.log and self.low <= 0:
            raise ValueError(f"log scale needs low > 0, got {self.low}; raise low or set log: false")
        if self.log and self.step is not None:
            raise ValueError("`log` and `step` cannot be combined (Optuna forbids it); drop one")
        if self.type == "int" and (self.low != int(self.low) or self.high != int(self.high)):
            raise ValueError(f"an int parameter needs whole low/high, got {self.low}..{self.high}")
        if self.step is not None:
            if self.type == "int" and self.step != int(self.step):
                raise ValueError(f"an int parameter needs a whole step, got {self.step}")
            if self.step > self.high - self.low:
                raise ValueError(
                    f"step {self.step} is larger than the range {self.low}..{self.high}, so only low "
                    "could ever be tried; lower step or widen the range"
                )
        return self

    def n_values(self) -> int:
        """How many values an enumerable parameter takes (counted, not listed: a range may be astronomically long)."""
        if self.type == "categorical":
            return len(self.choices or [])
        assert self.low is not None and self.high is not None and self.is_finite()
        if self.type == "int":
            return (int(self.high) - int(self.low)) // int(self.step or 1) + 1
        assert self.step is not None
        return int(round((self.high - self.low) / self.step)) + 1  # as traingate.sweep.space.grid lists them

    def is_finite(self) -> bool:
        """Whether the values can be enumerated (what the grid sampler needs)."""
        return self.type in ("categorical", "int") or self.step is not None

    def can_take(self, value: Any) -> bool:
        """Whether sampling can produce ``value`` (what a `when` condition on this parameter needs)."""
        if self.type == "categorical":
            return any(type(value) is type(c) and value == c for c in self.choices or [])
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        assert self.low is not None and self.high is not None  # validated above
        return self.low <= value <= self.high


class Objective(_M):
    metric: str = Field(
        default="val_accuracy", min_length=1, description="a stage metric, or cost_usd / duration_s / steps"
    )
    direction: Literal["minimize", "maximize"] = "maximize"


class SchedulerSpec(_M):
    """How much budget a trial gets. Resources are training steps."""

    name: Literal["fifo", "median", "asha", "hyperband", "pbt"] = "fifo"
    report_every: int = Field(default=10, ge=1, description="steps between intermediate validations")
    min_resource: int | None = Field(default=None, ge=1, description="steps before the first cut; default report_every")
    reduction_factor: int = Field(default=3, ge=2)
    startup_trials: int = Field(default=2, ge=0, description="median: trials that are never pruned")
    warmup_steps: int = Field(default=0, ge=0, description="median: steps before pruning is considered")
    # Population-based training: every `pbt_interval` steps the bottom quantile copies a top
    # trial's checkpoint and perturbs its hyperparameters.
    pbt_interval: int | None = Field(default=None, ge=1, description="steps per PBT generation; default report_every")
    pbt_quantile: float = Field(default=0.25, gt=0, le=0.5)
    pbt_perturb: list[float] = Field(default_factory=lambda: [0.8, 1.2], min_length=1)


class SweepBudget(_M):
    max_wall_s: float | None = Field(default=None, gt=0, le=MAX_SECONDS, description="stop starting trials after this")
    max_cost_usd: float | None = Field(default=None, ge=0, description="stop starting trials once spent")


class PromotionSpec(_M):
    """The winner's rule: optionally re-run the top-K configurations with new seeds first."""

    top_k: int = Field(default=0, ge=0, description="configurations re-run with new seeds (0 = none)")
    seeds: int = Field(default=2, ge=1, description="new seeds per re-run configuration")
    require_reproducible: bool = False
    tolerance: float = Field(
        default=0.02, ge=0, description="max |mean over new seeds - sweep value| of the winner's objective"
    )
    until: Literal["smoke", "canary", "full"] = "full"

    @model_validator(mode="after")
    def _needs_reruns(self) -> PromotionSpec:
        if self.require_reproducible and self.top_k == 0:
            raise ValueError("require_reproducible needs top_k >= 1 (the configurations to re-run)")
        return self


class SweepSpec(_M):
    study: str | None = Field(default=None, description="Optuna study name; default from experiment and spec hash")
    space: dict[str, ParamSpec] = Field(min_length=1, description="dotted spec path -> distribution")
    objectives: list[Objective] = Field(default_factory=lambda: [Objective()], min_length=1)
    sampler: Literal["grid", "random", "tpe", "cmaes", "nsga2"] = "tpe"
    seed: int = Field(default=0, ge=0, le=MAX_SEED, description="sampler seed")
    population_size: int = Field(default=8, ge=2, le=MAX_TRIALS, description="nsga2 population")
    scheduler: SchedulerSpec = SchedulerSpec()
    n_trials: int = Field(default=10, ge=1, le=MAX_TRIALS)
    max_concurrent: int = Field(default=1, ge=1, le=MAX_TRIALS)
    budget: SweepBudget = SweepBudget()
    stage: Literal["smoke", "canary", "full"] = "canary"
    pool_limit: str | None = Field(
        default=None,
        description="Prefect global concurrency limit of the work pool's "
        "slots; each trial also occupies its world size there",
    )
    heartbeat_s: float = Field(
        default=10.0, gt=0, le=MAX_SECONDS, description="trial heartbeat into the Optuna storage"
    )
    grace_s: float = Field(
        default=60.0, gt=0, le=MAX_SECONDS, description="a RUNNING trial silent this long is re-queued"
    )
    promotion: PromotionSpec = PromotionSpec()

    @field_validator("study")
    @classmethod
    def _study_is_a_name(cls, v: str | None) -> str | None:
        return v if v is None else check_name(v)

    @model_validator(mode="after")
    def _coherent(self) -> SweepSpec:
        names = list(self.space)
        for i, (name, p) in enumerate(self.space.items()):
            for dep, want in (p.when or {}).items():
                if dep not in names[:i]:
                    raise ValueError(
                        f"space.{name}.when refers to {dep!r}, which is not an earlier parameter; "
                        f"declare {dep!r} above {name!r}"
                    )
                wanted = want if isinstance(want, list) else [want]
                if not any(self.space[dep].can_take(w) for w in wanted):
                    raise ValueError(
                        f"space.{name}.when wants {dep} = {want!r}, which {dep!r} never takes, so "
                        f"{name!r} would never be sampled; use one of its values"
                    )
        if len(self.objectives) > 1 and self.scheduler.name != "fifo":
            raise ValueError(
                f"scheduler {self.scheduler.name!r} prunes on one objective, but "
                f"{len(self.objectives)} are set; use scheduler: {{name: fifo}} for multi-objective"
            )
        if len(self.objectives) > 1 and self.sampler in ("cmaes",):
            raise ValueError("sampler 'cmaes' is single-objective; use nsga2, tpe or random for several objectives")
        if self.sampler == "grid":
            cont = [n for n, p in self.space.items() if not p.is_finite()]
            if cont:
                raise ValueError(
                    f"sampler 'grid' needs enumerable values, but {cont} are continuous; give them `step` or `choices`"
                )
            if any(p.when for p in self.space.values()):
                raise ValueError("sampler 'grid' cannot sample conditional parameters; drop `when` or use tpe")
            points = math.prod(p.n_values() for p in self.space.values())
            if points > MAX_GRID_POINTS:
                sizes = ", ".join(f"{n}: {p.n_values()}" for n, p in self.space.items())
                raise ValueError(
                    f"sampler 'grid' would enumerate {points:.3g} points ({sizes}), more than the "
                    f"{MAX_GRID_POINTS} a grid may hold in memory; coarsen `step`, narrow the ranges or use tpe/random"
                )
        return self

    @property
    def directions(self) -> list[Literal["minimize", "maximize"]]:
        return [o.direction for o in self.objectives]
