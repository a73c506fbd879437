"""The capacity config: pools (one per GPU node class), priority classes, team quotas and the
scheduling defaults. One YAML file (``examples/pools.yaml``), validated here; a bad value is one
``CapacityError`` line naming the field, the value and the fix.

>>> cfg = parse_config({"pools": {"gpu-a100": {"gpu": "A100-80GB", "gpus_per_node": 8, "nodes": 8,
...                                            "price_per_gpu_hour": 2.5, "worker": "docker"}}})
>>> cfg.pools["gpu-a100"].capacity, sorted(cfg.priority_classes, key=cfg.rank)
(64, ['urgent', 'production', 'research'])
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from traingate.spec import SpecError, _one_line


class CapacityError(SpecError):
    """A capacity config or trace that cannot be used. One line: where, the value, the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Engine(StrEnum):
    """Who schedules a pool's jobs: traingate's own gang slots on one machine, or a Slurm controller."""

    LOCAL = "local"
    SLURM = "slurm"


class Placement(StrEnum):
    """Where a job goes among the nodes and GPUs that fit it, on a pool with shared GPUs
    (:mod:`traingate.capacity.fill` defines both)."""

    BESTFIT = "bestfit"
    FGD = "fgd"


class SlurmPool(_Section):
    """Where a Slurm pool's jobs go. The controller is the one the worker's host reaches through the
    Slurm CLI (``SLURM_CONF`` in its environment); accounts are teams, QOS are priority classes."""

    partition: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="the Slurm partition of the pool's nodes")
    gres_type: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="GPU gres type (gpu:<type>:<n>); null: any GPU type (gpu:<n>)",
    )
    sbatch_args: list[str] = Field(default_factory=list, description="extra sbatch options, e.g. ['--constraint=ib']")

    @field_validator("sbatch_args")
    @classmethod
    def _options_only(cls, args: list[str]) -> list[str]:
        for a in args:
            if not a.startswith("-"):
                raise ValueError(f"{a!r} is not an sbatch option; write each as one '--name=value' string")
        return args


class PoolConfig(_Section):
    """One node class. Its GPUs are the pool's slots; a job wider than a node takes whole nodes."""

    gpu: str | None = Field(default=None, description="GPU model, e.g. A100-80GB; null for a CPU pool")
    gpus_per_node: int = Field(ge=1, description="slots per node (CPU pools: processes per node)")
    nodes: int = Field(ge=1)
    price_per_gpu_hour: float = Field(ge=0)
    worker: Literal["process", "docker", "kubernetes"] = Field(description="Prefect worker type of the pool")
    engine: Engine = Field(default=Engine.LOCAL, description="local (traingate's gang slots) or slurm (sbatch)")
    slurm: SlurmPool | None = Field(default=None, description="engine: slurm only: partition, gres type, sbatch args")

    @field_validator("engine", mode="before")
    @classmethod
    def _known_engine(cls, v: Any) -> Any:
        if isinstance(v, str) and v not in {e.value for e in Engine}:
            raise ValueError(f"unknown engine {v!r}; use one of {', '.join(e.value for e in Engine)}")
        return v

    @model_validator(mode="after")
    def _engine_section(self) -> PoolConfig:
        if self.engine == Engine.SLURM and self.slurm is None:
            raise ValueError("engine: slurm needs a `slurm:` section ({partition: NAME, gres_type: TYPE}); add it")
        if self.engine != Engine.SLURM and self.slurm is not None:
            raise ValueError(
                f"a `slurm:` section on an engine: {self.engine} pool does nothing; "
                "set engine: slurm or remove the section"
            )
        return self

    @property
    def capacity(self) -> int:
        return self.gpus_per_node * self.nodes


class PriorityClass(_Section):
    priority: int = Field(description="higher runs first")
    preempts: bool = Field(default=False, description="may stop running jobs of lower classes to get its slots")


def _default_classes() -> dict[str, PriorityClass]:
    return {
        "urgent": PriorityClass(priority=100, preempts=True),
        "production": PriorityClass(priority=50),
        "research": PriorityClass(priority=10),
    }


# Every pools file has these (its own are merged over them), so they are the classes where no pools file is known.
BUILTIN_CLASSES = "the built-in classes (no pools file)"


@functools.cache
def _class_enum(names: tuple[str, ...]) -> type[StrEnum]:
    """One enum per set of classes: the same pools file gives the same enum, whose members compare by identity."""
    return StrEnum("PriorityClassName", [(n, n) for n in names])  # type: ignore[return-value]


def priority_class(cfg: CapacityConfig | None, name: str, source: str) -> StrEnum:
    """``name`` as a member of the priority classes of ``cfg`` (read from ``source``; None: the built-in
    classes), or one CapacityError line naming ``resources.priority``, the value and the classes there are.

    >>> priority_class(None, "urgent", BUILTIN_CLASSES)
    <PriorityClassName.urgent: 'urgent'>
    >>> priority_class(None, "urgnet", BUILTIN_CLASSES)
    Traceback (most recent call last):
    traingate.capacity.pools.CapacityError: resources.priority = 'urgnet': not a priority class of the built-in \
classes (no pools file); use one of urgent, production, research
    """
    classes = cfg.classes if cfg is not None else _class_enum(tuple(_default_classes()))
    try:
        return classes(name)
    except ValueError:
        raise CapacityError(
            f"resources.priority = {name!r}: not a priority class of {source}; use one of {', '.join(classes)}"
        ) from None


class Period(StrEnum):
    """A team budget's period: a calendar day, week (from Monday) or month, in UTC."""

    DAY = "day"
    WEEK = "week"
    MONTH = "month"


class TeamBudget(_Section):
    budget_usd: float = Field(gt=0, description="what the team's runs may spend per period (slot-hours x price)")
    period: Period = Field(description="day, week or month (calendar, UTC): the spend starts at 0 again after it")


class Entitlement(_Section):
    """What one team's members may ask of the local engine: priority classes and a slot quota per pool."""

    members: list[str] = Field(default_factory=list, description="OS user names that run jobs for the team")
    classes: list[str] = Field(min_length=1, description="priority classes the team's jobs may use")
    quota: dict[str, int] = Field(default_factory=dict, description="pool -> max slots the team holds at once")


class DefaultEntitlement(_Section):
    """What a team that ``entitlements.teams`` does not list gets: a class list and a quota on every local pool."""

    classes: list[str] = Field(min_length=1, description="priority classes an unlisted team may use")
    quota: dict[str, int] = Field(description="local pool -> max slots each unlisted team holds at once")


class Entitlements(_Section):
    """Who may use which priority class and quota on the local engine. The team and member of a job come
    from the OS user running traingate (checked by the pool's authority from its socket's peer
    credentials), not from the spec."""

    default: DefaultEntitlement
    teams: dict[str, Entitlement] = Field(default_factory=dict)


class SchedulingConfig(_Section):
    """The policy a pool runs by default (part 2 carries it out; the simulator compares it)."""

    half_life_h: float = Field(default=24.0, gt=0, description="fair share: usage loses half its weight after this")
    backfill: bool = Field(default=True, description="EASY backfill behind a blocked job")
    preemption: bool = Field(default=True, description="classes with preempts: true may stop lower classes")
    starvation_bound_h: float | None = Field(
        default=24.0,
        gt=0,
        description="a job submitted this long ago and still waiting ranks ahead of every later one, oldest first, "
        "whatever its class (the default policy's +aged); null: class order always",
    )


class SlurmPriorityConfig(_Section):
    """Slurm's multifactor job priority, as the simulator's ``multifactor`` order computes it (the
    defaults are the Slurm test cluster's slurm.conf: QOS above fair share above age)."""

    weight_qos: float = Field(default=100000.0, ge=0, description="PriorityWeightQOS")
    weight_fairshare: float = Field(default=10000.0, ge=0, description="PriorityWeightFairshare")
    weight_age: float = Field(default=100.0, ge=0, description="PriorityWeightAge")
    max_age_h: float = Field(default=168.0, gt=0, description="PriorityMaxAge: the age factor is 1 from here")
    calc_period_s: float = Field(
        default=60.0, ge=0, description="PriorityCalcPeriod: fair-share usage is refreshed this often (0: always)"
    )
    bf_resolution_s: float = Field(
        default=60.0, ge=0, description="bf_resolution: a backfilled job must end this long before the head's start"
    )


class SimulatorConfig(_Section):
    """What a trace does not say about its jobs but the simulator needs."""

    checkpoint_every_s: float = Field(
        default=1800.0, gt=0, description="a preempted job loses its work since the last one"
    )
    restart_cost_s: float = Field(
        default=120.0, ge=0, description="slots held without progress when a preempted job resumes"
    )
    preempt_grace_s: float = Field(
        default=30.0, ge=0, description="the victims' emergency checkpoint, paid by the preemptor"
    )
    slurm_priority: SlurmPriorityConfig = Field(
        default_factory=SlurmPriorityConfig, description="the weights of the multifactor order (Slurm mode)"
    )
    placement: Placement = Field(
        default=Placement.BESTFIT,
        description="where the replay places jobs on a pool whose trace jobs ask fractions of a GPU: bestfit or fgd",
    )


class CapacityConfig(_Section):
    pools: dict[str, PoolConfig] = Field(min_length=1)
    priority_classes: dict[str, PriorityClass] = Field(
        default_factory=_default_classes,
        description="merged over urgent/production/research: the config may re-number them and add classes",
    )
    default_class: str = Field(default="research", description="class of a job that names none")
    quotas: dict[str, dict[str, int]] = Field(default_factory=dict, description="team -> pool -> max concurrent slots")
    team_budgets: dict[str, TeamBudget] = Field(
        default_factory=dict,
        description="team -> spend per period; a stage estimated above what is left is refused at its gate",
    )
    entitlements: Entitlements | None = Field(
        default=None,
        description="team -> members, classes, quota; absent: every OS user may use every class (one-user machine)",
    )
    scheduling: SchedulingConfig = SchedulingConfig()
    simulator: SimulatorConfig = SimulatorConfig()

    @model_validator(mode="before")
    @classmethod
    def _merge_builtin_classes(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("priority_classes"), dict):
            data = {
                **data,
                "priority_classes": {
                    **{k: v.model_dump() for k, v in _default_classes().items()},
                    **data["priority_classes"],
                },
            }
        return data

    @model_validator(mode="after")
    def _references_resolve(self) -> CapacityConfig:
        seen: dict[int, str] = {}
        for name, pc in sorted(self.priority_classes.items()):
            if pc.priority in seen:
                raise ValueError(
                    f"priority_classes.{name}.priority = {pc.priority}: same as class "
                    f"{seen[pc.priority]!r}; give each class its own priority"
                )
            seen[pc.priority] = name
        if self.default_class not in self.priority_classes:
            raise ValueError(
                f"default_class = {self.default_class!r}: not a priority class; "
                f"use one of {sorted(self.priority_classes)}"
            )
        for team, caps in self.quotas.items():
            for pool, cap in caps.items():
                if pool not in self.pools:
                    raise ValueError(f"quotas.{team}.{pool}: {pool!r} is not a pool; use one of {sorted(self.pools)}")
                if self.pools[pool].engine == Engine.SLURM:
                    raise ValueError(
                        f"quotas.{team}.{pool}: {pool!r} is a Slurm pool, whose quotas are its accounts' "
                        f"limits; remove the entry and set sacctmgr modify account {team} set "
                        f"GrpTRES=gres/gpu={cap}"
                    )
                if cap < 1:
                    raise ValueError(
                        f"quotas.{team}.{pool} = {cap}: a quota is at least 1 slot; "
                        f"remove the entry to leave the team uncapped"
                    )
        if self.entitlements is not None:
            self._entitlements_resolve(self.entitlements)
        return self

    def _entitlements_resolve(self, ent: Entitlements) -> None:
        local = sorted(n for n, p in self.pools.items() if p.engine == Engine.LOCAL)
        sections = [("entitlements.default", ent.default.classes, ent.default.quota)]
        sections += [(f"entitlements.teams.{t}", e.classes, e.quota) for t, e in ent.teams.items()]
        for where, classes, quota in sections:
            for c in classes:
                if c not in self.priority_classes:
                    raise ValueError(
                        f"{where}.classes: {c!r} is not a priority class; use some of {sorted(self.priority_classes)}"
                    )
            for pool, cap in quota.items():
                if pool not in local:
                    raise ValueError(f"{where}.quota.{pool}: {pool!r} is not a local pool; use some of {local}")
                if cap < 1:
                    raise ValueError(f"{where}.quota.{pool} = {cap}: a quota is at least 1 slot; raise it")
        missing = [p for p in local if p not in ent.default.quota]
        if missing:
            raise ValueError(
                f"entitlements.default.quota: no quota for local pool {missing[0]!r}; an unlisted team is not "
                f"unlimited: add {missing[0]}: SLOTS"
            )
        for team, e in ent.teams.items():
            both = sorted(set(e.quota) & set(self.quotas.get(team, {})))
            if both:
                raise ValueError(
                    f"entitlements.teams.{team}.quota.{both[0]}: also set in quotas.{team}.{both[0]}; "
                    f"keep one of the two"
                )

    def quota_of(self, team: str, pool: str) -> int | None:
        """The most slots ``team`` holds at once on ``pool``: its entitlement, its ``quotas`` entry, or, with
        entitlements, the default quota for a team they do not list; None: uncapped."""
        ent = self.entitlements
        if ent is not None and team in ent.teams and pool in ent.teams[team].quota:
            return ent.teams[team].quota[pool]
        if pool in self.quotas.get(team, {}):
            return self.quotas[team][pool]
        if ent is not None and team not in ent.teams:
            return ent.default.quota.get(pool)
        return None

    @property
    def classes(self) -> type[StrEnum]:
        """This file's priority classes as an enum, the most important first."""
        return _class_enum(tuple(sorted(self.priority_classes, key=self.rank)))

    def rank(self, priority_class: str) -> int:
        """Sort key: the most important class first."""
        return -self.priority_classes[priority_class].priority

    def quotas_on(self, pool: str, teams: Iterable[str] = ()) -> dict[str, int]:
        """Team -> slot cap on ``pool`` for every team with one, ``teams`` included (with entitlements, an
        unlisted team has the default quota); teams without a cap are absent (uncapped)."""
        names = set(self.quotas) | set(teams) | set(self.entitlements.teams if self.entitlements else ())
        caps = {team: self.quota_of(team, pool) for team in sorted(names)}
        return {team: cap for team, cap in caps.items() if cap is not None}


def parse_config(tree: Any, source: str = "capacity config") -> CapacityConfig:
    if not isinstance(tree, dict):
        raise CapacityError(f"{source}: top level must be a mapping with `pools:`; see examples/pools.yaml")
    try:
        return CapacityConfig.model_validate(tree)
    except ValidationError as e:
        raise CapacityError(f"{source}: {_one_line(e)}") from None


def load_config(path: str | Path) -> CapacityConfig:
    p = Path(path)
    if not p.is_file():
        raise CapacityError(f"pools config {str(path)!r} does not exist; pass a YAML file like examples/pools.yaml")
    try:
        tree = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise CapacityError(f"{path}:{where} is not valid YAML ({getattr(e, 'problem', e)}); fix the syntax") from None
    return parse_config(tree, source=str(path))
