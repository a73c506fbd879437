"""RunSpec: the one config tree. A YAML file plus ``--set a.b=c`` overrides.

Each section validates itself where it is defined; ``load_spec`` turns any
violation into one ``SpecError`` line that names the field, the value and the fix.

>>> spec = load_spec_text("identity: {experiment: e, owner: me, team: t, purpose: p}\\n"
...                       "recipe: {name: digits-cnn}", overrides=["optim.lr=0.01"])
>>> spec.optim.lr
0.01
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from traingate.sweep.config import SweepSpec

STAGES = ("unit", "smoke", "canary", "full")
Stage = Literal["unit", "smoke", "canary", "full"]
TRAINING_STAGES = ("smoke", "canary", "full")


class SpecError(ValueError):
    """A spec that cannot run. The message is one line: field, value, fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Identity(_Section):
    experiment: str = Field(min_length=1)
    owner: str = Field(min_length=1)
    team: str = Field(min_length=1)
    purpose: str = Field(min_length=1, description="one sentence of intent")
    run_name: str | None = None


class ScriptRecipe(_Section):
    """An existing training command run unmodified, under torchrun or as-is."""

    command: list[str] = Field(min_length=1)
    workdir: str = Field(default=".", description="relative to the spec file's directory")
    launcher: Literal["torchrun", "plain"] = "plain"
    stage_args: dict[Literal["smoke", "canary", "full"], list[str]] = Field(default_factory=dict)
    # Regexes with named groups; each named group is a metric, a group named `step` is the step.
    metrics: list[str] = Field(default_factory=list)
    tests: list[str] = Field(default_factory=list, description="pytest paths, relative to workdir")
    timeout_s: float = Field(default=3600.0, gt=0)

    @field_validator("metrics")
    @classmethod
    def _regexes_compile(cls, patterns: list[str]) -> list[str]:
        for p in patterns:
            try:
                rx = re.compile(p)
            except re.error as e:
                raise ValueError(f"regex {p!r} does not compile ({e}); fix the pattern") from None
            if not set(rx.groupindex) - {"step"}:
                raise ValueError(f"regex {p!r} has no named metric group; write e.g. 'loss=(?P<loss>[0-9.eE+-]+)'")
        return patterns


class RecipeSpec(_Section):
    name: str = Field(min_length=1, description="a registered recipe, or 'script'")
    params: dict[str, Any] = Field(default_factory=dict)
    script: ScriptRecipe | None = None

    @model_validator(mode="after")
    def _script_needs_section(self) -> "RecipeSpec":
        if self.name == "script" and self.script is None:
            raise ValueError("recipe 'script' needs a recipe.script section with at least `command`")
        if self.name != "script" and self.script is not None:
            raise ValueError(f"recipe.script is only for name 'script', not {self.name!r}; remove it or set name: script")
        return self


class DataSpec(_Section):
    uri: str | None = Field(default=None, description="dataset/corpus location; recipe default if unset")
    val_fraction: float = Field(default=0.1, gt=0, lt=1)


class OptimSpec(_Section):
    lr: float = Field(default=3e-3, ge=0)
    weight_decay: float = Field(default=0.0, ge=0)
    batch_size: int = Field(default=32, ge=1, description="per process, per micro-batch")
    grad_accum: int = Field(default=1, ge=1)
    warmup_steps: int = Field(default=0, ge=0)
    schedule: Literal["constant", "cosine"] = "cosine"
    max_grad_norm: float = Field(default=1.0, gt=0)
    seed: int = Field(default=0, ge=0)
    nonfinite_tolerance: int = Field(default=0, ge=0, description="non-finite steps skipped before stopping as diverged")


class ResourcesSpec(_Section):
    work_pool: str = "cpu-local"
    nodes: int = Field(default=1, ge=1)
    procs_per_node: int = Field(default=2, ge=1)
    rdzv_endpoint: str | None = Field(default=None, description="host:port of the c10d rendezvous for multi-node")

    @model_validator(mode="after")
    def _multinode_needs_rendezvous(self) -> "ResourcesSpec":
        if self.nodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"nodes={self.nodes} needs resources.rdzv_endpoint (host:port of the c10d rendezvous)")
        return self


class StageLimits(_Section):
    max_steps: int = Field(ge=1)
    max_samples: int | None = Field(default=None, ge=1, description="train on only the first N samples")
    timeout_s: float = Field(default=3600.0, gt=0)


class StagesSpec(_Section):
    smoke: StageLimits = StageLimits(max_steps=6, max_samples=128)
    canary: StageLimits = StageLimits(max_steps=60)
    full: StageLimits = StageLimits(max_steps=200)


class GateRule(_Section):
    metric: str = Field(min_length=1)
    op: Literal["<", "<=", ">", ">=", "==", "!="]
    value: float


class GateSpec(_Section):
    rules: list[GateRule] = Field(default_factory=list)
    require_approval: bool = False
    approval_timeout_s: float = Field(default=3600.0, gt=0)


def default_gate(stage: str, script: bool) -> GateSpec:
    """The gate a stage gets when the spec names none for it."""
    r = GateRule
    finite = r(metric="nonfinite_steps", op="==", value=0)
    table = {
        "unit": [r(metric="tests_failed", op="==", value=0), r(metric="tests_passed", op=">=", value=1)],
        # The smoke stage of a built-in recipe stops half way and resumes: prove that it did.
        "smoke": [finite] if script else [r(metric="resumed_from_step", op=">=", value=1), finite],
        "canary": [r(metric="loss_decrease_fraction", op=">=", value=0.1), finite]
        + ([] if script else [r(metric="max_grad_norm", op="<=", value=1e3)]),
        "full": [finite],
    }
    return GateSpec(rules=table[stage])


class CheckpointSpec(_Section):
    every_steps: int | None = Field(default=50, ge=1)
    every_minutes: float | None = Field(default=None, gt=0)
    keep_last: int = Field(default=3, ge=1)
    keep_every: int | None = Field(default=None, ge=1, description="also keep every Nth step forever")
    keep_best: int = Field(default=0, ge=0, description="also keep the N best checkpoints by best_metric")
    best_metric: str = Field(default="train_loss", min_length=1,
                             description="metric in each manifest that keep_best ranks by (mean since last save)")
    best_mode: Literal["min", "max"] = "min"
    uri: str | None = Field(default=None, description="checkpoint root URI; settings default if unset")
    async_save: bool = True
    in_flight: Literal["wait", "skip"] = Field(
        default="wait", description="a save due while the previous one is still being written: wait for it, or skip")


class SupervisionSpec(_Section):
    """How a training stage is restarted after faults (see traingate.supervision)."""

    max_restarts: int = Field(default=5, ge=0, description="restarts per stage before giving up")
    max_downtime_s: float = Field(default=3600.0, gt=0, description="wall-clock of failed launches + backoff, per stage")
    backoff_base_s: float = Field(default=1.0, ge=0, description="first restart delay; doubles each restart, with jitter")
    backoff_max_s: float = Field(default=60.0, ge=0)
    hang_timeout_s: float | None = Field(default=None, gt=0,
                                         description="no step for this long = hang; default 2x canary p99, >= floor")
    hang_floor_s: float = Field(default=60.0, gt=0)
    startup_timeout_s: float = Field(default=300.0, gt=0, description="launch -> first heartbeat of every rank")
    preempt_grace_s: float = Field(default=30.0, ge=0, description="SIGTERM -> SIGKILL, for the emergency checkpoint")
    oom_halve_batch: bool = Field(default=False, description="on OOM retry with half the micro-batch, 2x grad_accum")
    checkpoint_check_s: float = Field(default=10.0, gt=0, description="how often to look for a stale checkpoint")


class TrackingSpec(_Section):
    enabled: bool = True
    log_every: int = Field(default=10, ge=1)


class PoolSpec(_Section):
    price_per_gpu_hour: float = Field(ge=0)
    gpus_per_node: int = Field(default=0, ge=0, description="0 = CPU pool (one slot per process)")
    backend: Literal["gloo", "nccl"] = "gloo"


def _default_pools() -> dict[str, PoolSpec]:
    # Rough on-demand prices; override per organisation in the spec's `pools` section.
    return {
        "cpu-local": PoolSpec(price_per_gpu_hour=0.05, gpus_per_node=0, backend="gloo"),
        "gpu-a100": PoolSpec(price_per_gpu_hour=2.50, gpus_per_node=8, backend="nccl"),
        "gpu-h100": PoolSpec(price_per_gpu_hour=4.00, gpus_per_node=8, backend="nccl"),
    }


class BudgetSpec(_Section):
    max_cost_usd: float | None = Field(default=None, ge=0, description="refuse a stage estimated above this")


class RunSpec(_Section):
    identity: Identity
    recipe: RecipeSpec
    data: DataSpec = DataSpec()
    optim: OptimSpec = OptimSpec()
    resources: ResourcesSpec = ResourcesSpec()
    stages: StagesSpec = StagesSpec()
    gates: dict[Stage, GateSpec] = Field(default_factory=dict, description="per stage; unset stages get default_gate")
    checkpoint: CheckpointSpec = CheckpointSpec()
    supervision: SupervisionSpec = SupervisionSpec()
    tracking: TrackingSpec = TrackingSpec()
    budget: BudgetSpec = BudgetSpec()
    pools: dict[str, PoolSpec] = Field(default_factory=_default_pools)
    sweep: SweepSpec | None = Field(default=None, description="hyperparameter sweep (traingate sweep SPEC)")

    @model_validator(mode="after")
    def _pool_is_known(self) -> "RunSpec":
        if self.resources.work_pool not in self.pools:
            raise ValueError(
                f"resources.work_pool {self.resources.work_pool!r} is not a known pool; "
                f"use one of {sorted(self.pools)} or add it under `pools:`")
        pool = self.pools[self.resources.work_pool]
        if pool.gpus_per_node and self.resources.procs_per_node > pool.gpus_per_node:
            raise ValueError(
                f"resources.procs_per_node {self.resources.procs_per_node} exceeds the "
                f"{pool.gpus_per_node} GPUs per node of pool {self.resources.work_pool!r}; lower it")
        return self

    @property
    def pool(self) -> PoolSpec:
        return self.pools[self.resources.work_pool]

    @property
    def world_size(self) -> int:
        return self.resources.nodes * self.resources.procs_per_node

    def gate(self, stage: str) -> GateSpec:
        return self.gates.get(stage) or default_gate(stage, script=self.recipe.name == "script")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def spec_hash(self) -> str:
        """Content hash of the resolved spec (key order does not matter)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def flat(self) -> dict[str, str]:
        """The resolved spec as dotted keys, for MLflow params."""
        out: dict[str, str] = {}

        def walk(prefix: str, node: Any) -> None:
            if isinstance(node, dict) and node:
                for k, v in node.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
            else:
                out[prefix] = json.dumps(node) if isinstance(node, (list, dict)) else str(node)

        walk("", self.to_dict())
        return out


# ---------------------------------------------------------------- parsing

def _parse_value(raw: str) -> Any:
    # YAML scalars: `3e-4` -> float, `true` -> bool, `[a, b]` -> list, `x` -> str.
    value = yaml.safe_load(raw) if raw.strip() else ""
    if isinstance(value, str) and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+", value.strip()):
        return float(value)  # YAML 1.1 reads `3e-4` as a string
    return value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides in order to a nested dict (in place)."""
    for item in overrides:
        if "=" not in item:
            raise SpecError(f"--set {item!r}: expected key=value, e.g. --set optim.lr=0.001")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise SpecError(f"--set {item!r}: empty key part in {key!r}; write dotted keys like optim.lr")
        node = tree
        for p in parts[:-1]:
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            if not isinstance(child, dict):
                raise SpecError(f"--set {item!r}: {p!r} is a value ({child!r}), not a section; set {key.rsplit('.', 1)[0]} instead")
            node = child
        node[parts[-1]] = _parse_value(raw)
    return tree


_FIXES = {
    "extra_forbidden": "unknown key; remove it or check its spelling",
    "missing": "required; add it",
    "literal_error": "not an allowed value",
    "int_parsing": "must be an integer",
    "int_from_float": "must be a whole number",
    "float_parsing": "must be a number",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "dict_type": "must be a mapping (key: value)",
    "list_type": "must be a list",
    "model_type": "must be a mapping (key: value)",
    "too_short": "must not be empty",
    "string_too_short": "must not be empty",
}


_BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"),
           "less_than_equal": ("le", "<="), "less_than": ("lt", "<")}


def _one_line(err: ValidationError) -> str:
    e = err.errors()[0]
    parts = [str(p) for p in e["loc"]]
    is_key = "[key]" in parts
    loc = ".".join(p for p in parts if p != "[key]") or "spec"
    value = e.get("input")
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "value_error" and isinstance(value, dict):
        text = msg if loc == "spec" else f"{loc}: {msg}"  # a cross-field check: its message names the fields
    else:
        shown = "(absent)" if e["type"] == "missing" else repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        if is_key:
            loc = loc.rsplit(".", 1)[0] + f".{value}" if "." in loc else str(value)
            msg = f"unknown key; {msg[0].lower()}{msg[1:]}"
        fix = _FIXES.get(e["type"])
        if e["type"] in _BOUNDS:
            key, op = _BOUNDS[e["type"]]
            fix = f"set it to a value {op} {e.get('ctx', {}).get(key)}"
        text = f"{loc} = {shown}: {msg}" + (f" ({fix})" if fix and fix.lower() not in msg.lower() else "")
    more = len(err.errors()) - 1
    return text + (f" [+{more} more error(s)]" if more else "")


def parse_spec(tree: Any) -> RunSpec:
    if not isinstance(tree, dict):
        raise SpecError(f"spec: top level must be a mapping of sections, got {type(tree).__name__}; see examples/digits.yaml")
    try:
        return RunSpec.model_validate(tree)
    except ValidationError as e:
        raise SpecError(_one_line(e)) from None


def load_spec_text(text: str, overrides: list[str] | None = None, source: str = "<spec>") -> RunSpec:
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise SpecError(f"{source}:{where} is not valid YAML ({getattr(e, 'problem', e)}); fix the syntax") from None
    tree = {} if tree is None else tree
    if isinstance(tree, dict):
        apply_overrides(tree, overrides or [])
    return parse_spec(tree)


def load_spec(path: str | Path, overrides: list[str] | None = None) -> RunSpec:
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"spec file {str(path)!r} does not exist; pass the path of a YAML spec")
    spec = load_spec_text(p.read_text(), overrides, source=str(path))
    script = spec.recipe.script
    if script is not None and not Path(script.workdir).is_absolute():
        # A script's workdir is relative to the spec file, so a spec works from any cwd.
        script.workdir = str((p.resolve().parent / script.workdir).resolve())
    return spec


def write_resolved(spec: RunSpec, path: str | Path) -> Path:
    """Write the resolved spec (every default filled in) where a training process can read it."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(spec.to_dict(), sort_keys=False))
    return p
