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
import math
import re
import unicodedata
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from traingate.alerts.rules import AlertsSpec
from traingate.redact import redact
from traingate.specbase import MAX_SECONDS, MAX_SEED, SpecModel, check_name, url_problem
from traingate.sweepspec import SweepSpec

STAGES = ("unit", "smoke", "canary", "full")
Stage = Literal["unit", "smoke", "canary", "full"]
TRAINING_STAGES = ("smoke", "canary", "full")


class SpecError(ValueError):
    """A spec that cannot run. The message is one line: field, value, fix."""


class _Section(SpecModel):
    pass


PURPOSE_MAX = 500
# The most a GPU-hour costs anywhere is far below this; a larger price is a typo that would
# make every cost estimate and budget check meaningless.
MAX_PRICE_PER_GPU_HOUR = 10_000.0


class Identity(_Section):
    experiment: str = Field(min_length=1)
    owner: str = Field(min_length=1)
    team: str = Field(min_length=1)
    purpose: str = Field(min_length=1, max_length=PURPOSE_MAX, description="one sentence of intent")
    run_name: str | None = None

    # Experiment, run and team names become paths (MLflow artifact locations, ledgers) and
    # MLflow/Prefect object names: `../../x` wrote artifacts outside the state dir.
    @field_validator("experiment", "team", "run_name")
    @classmethod
    def _plain_name(cls, v: str | None) -> str | None:
        return v if v is None else check_name(v)

    @field_validator("owner")
    @classmethod
    def _owner_name(cls, v: str) -> str:
        return check_name(v, extra="@")  # user names and e-mail-style owners

    @field_validator("purpose")
    @classmethod
    def _one_sentence(cls, v: str) -> str:
        bad = sorted({repr(c) for c in v if unicodedata.category(c) == "Cc" and c not in "\n\t"})
        if bad:
            raise ValueError(f"contains control characters {', '.join(bad)}; write plain text")
        return v


PYTHONS = ("python", "python3")  # the commands a script recipe runs with traingate's own interpreter


class ScriptRecipe(_Section):
    """An existing training command run unmodified, under torchrun or as-is."""

    command: list[str] = Field(min_length=1)
    workdir: str = Field(default=".", description="relative to the spec file's directory")
    launcher: Literal["torchrun", "plain"] = "plain"
    stage_args: dict[Literal["smoke", "canary", "full"], list[str]] = Field(default_factory=dict)
    # Regexes with named groups; each named group is a metric, a group named `step` is the step and one named
    # `total` the script's own step total (progress and ETA count to it instead of the stage's max_steps).
    metrics: list[str] = Field(default_factory=list)
    tests: list[str] = Field(default_factory=list, description="pytest paths, relative to workdir")
    timeout_s: float = Field(default=3600.0, gt=0, le=MAX_SECONDS)
    # Words of command, stage_args and resume_args may name the platform's locations: ${TRAINGATE_CHECKPOINT_DIR},
    # ${TRAINGATE_STAGE_DIR}, ${TRAINGATE_RUN_ID}, ... (traingate.job.envvars), expanded at launch.
    resume_args: list[str] = Field(
        default_factory=list,
        description="appended on a restart when the script has "
        "written a checkpoint (its own resume flag, e.g. --resume ${TRAINGATE_CHECKPOINT_DIR}/last.pt)",
    )
    checkpoints: str | None = Field(
        default=None,
        description="glob of the checkpoint files the script writes, "
        "relative to ${TRAINGATE_CHECKPOINT_DIR}; indexed, uploaded and registered",
    )
    needs_cuda: bool = Field(default=False, description="the script runs on CUDA only: refused on a CPU pool")

    @field_validator("command", "tests", "resume_args")
    @classmethod
    def _no_empty_words(cls, words: list[str]) -> list[str]:
        for i, w in enumerate(words):
            if not w.strip():
                raise ValueError(f"item {i} is {w!r}: an empty word starts nothing; remove it or fill it in")
        return words

    @field_validator("stage_args")
    @classmethod
    def _no_empty_args(cls, args: dict[str, list[str]]) -> dict[str, list[str]]:
        for stage, words in args.items():
            for i, w in enumerate(words):
                if not w.strip():
                    raise ValueError(f"{stage} item {i} is {w!r}: an empty argument; remove it or fill it in")
        return args

    @model_validator(mode="after")
    def _runnable(self) -> ScriptRecipe:
        exe = self.command[0]
        python = exe in PYTHONS
        if self.launcher == "torchrun" and not python:
            raise ValueError(
                f"command[0] = {exe!r}: launcher torchrun starts python workers, so the "
                "command must be 'python train.py ...' or 'python -m pkg ...'; use launcher: plain otherwise"
            )
        if python and len(self.command) == 1:
            raise ValueError(
                f"command = {self.command!r}: python alone waits for a program on stdin; "
                "add the script (python train.py), a module (-m pkg) or code (-c ...)"
            )
        return self

    @field_validator("metrics")
    @classmethod
    def _regexes_compile(cls, patterns: list[str]) -> list[str]:
        for p in patterns:
            try:
                rx = re.compile(p)
            except re.error as e:
                raise ValueError(f"regex {p!r} does not compile ({e}); fix the pattern") from None
            if not set(rx.groupindex) - {"step", "total"}:  # the step and the script's step total are no metrics
                raise ValueError(f"regex {p!r} has no named metric group; write e.g. 'loss=(?P<loss>[0-9.eE+-]+)'")
        return patterns


class RecipeSpec(_Section):
    name: str = Field(min_length=1, description="a registered recipe, or 'script'")
    params: dict[str, Any] = Field(default_factory=dict)
    script: ScriptRecipe | None = None

    @model_validator(mode="after")
    def _script_needs_section(self) -> RecipeSpec:
        if self.name == "script" and self.script is None:
            raise ValueError("recipe 'script' needs a recipe.script section with at least `command`")
        if self.name != "script" and self.script is not None:
            raise ValueError(
                f"recipe.script is only for name 'script', not {self.name!r}; remove it or set name: script"
            )
        if self.name == "script" and self.params:
            raise ValueError(
                f"params = {self.params!r}: a script recipe is not given recipe.params; pass "
                "arguments in recipe.script.command or stage_args, and remove recipe.params"
            )
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
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    nonfinite_tolerance: int = Field(
        default=0, ge=0, description="non-finite steps skipped before stopping as diverged"
    )


# Past any machine and any cluster: a typo (an extra 000) would otherwise fork that many processes or
# wait forever for nodes that do not exist.
MAX_PROCS_PER_NODE = 1024
MAX_NODES = 10_000


class ResourcesSpec(_Section):
    work_pool: str = "cpu-local"
    nodes: int = Field(default=1, ge=1, le=MAX_NODES)
    procs_per_node: int = Field(default=2, ge=1, le=MAX_PROCS_PER_NODE)
    rdzv_endpoint: str | None = Field(default=None, description="host:port of the c10d rendezvous for multi-node")
    priority: str = Field(
        default="research",
        pattern=r"^[a-z][a-z0-9_-]{0,31}$",
        description="priority class of the jobs (a work queue of the pool): urgent, production, research",
    )

    @field_validator("rdzv_endpoint")
    @classmethod
    def _host_port(cls, v: str | None) -> str | None:
        if v is None:
            return v
        m = re.fullmatch(
            r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?):(?P<port>\d{1,5})", v
        )
        if m is None or not 1 <= int(m["port"]) <= 65535:
            raise ValueError(
                "must be host:port of the c10d rendezvous (a hostname, IPv4 or [IPv6] address and a "
                "port 1-65535), e.g. head-node:29400"
            )
        return v

    @model_validator(mode="after")
    def _multinode_needs_rendezvous(self) -> ResourcesSpec:
        if self.nodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"nodes={self.nodes} needs resources.rdzv_endpoint (host:port of the c10d rendezvous)")
        return self


class StageLimits(_Section):
    max_steps: int = Field(ge=1)
    max_samples: int | None = Field(default=None, ge=1, description="train on only the first N samples")
    timeout_s: float = Field(default=3600.0, gt=0, le=MAX_SECONDS)


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
    approval_timeout_s: float = Field(default=3600.0, gt=0, le=MAX_SECONDS)


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
    # A script's steps are what its output showed (recipe.script.metrics): none seen, nothing was trained
    # that any other rule could judge, and nonfinite_steps == 0 would hold vacuously.
    extra = [r(metric="steps", op=">=", value=1)] if script and stage in TRAINING_STAGES else []
    return GateSpec(rules=extra + table[stage])


class CheckpointSpec(_Section):
    every_steps: int | None = Field(default=50, ge=1)
    every_minutes: float | None = Field(default=None, gt=0, le=MAX_SECONDS / 60)
    keep_last: int = Field(default=3, ge=1)
    keep_every: int | None = Field(default=None, ge=1, description="also keep every Nth step forever")
    keep_best: int = Field(default=0, ge=0, description="also keep the N best checkpoints by best_metric")
    best_metric: str = Field(
        default="train_loss",
        min_length=1,
        description="metric in each manifest that keep_best ranks by (mean since last save)",
    )
    best_mode: Literal["min", "max"] = "min"
    uri: str | None = Field(default=None, description="checkpoint root URI; settings default if unset")
    async_save: bool = True
    in_flight: Literal["wait", "skip"] = Field(
        default="wait", description="a save due while the previous one is still being written: wait for it, or skip"
    )


class SupervisionSpec(_Section):
    """How a training stage is restarted after faults (see traingate.supervision)."""

    max_restarts: int = Field(default=5, ge=0, description="restarts per stage before giving up")
    max_downtime_s: float = Field(
        default=3600.0, gt=0, le=MAX_SECONDS, description="wall-clock of failed launches + backoff, per stage"
    )
    backoff_base_s: float = Field(
        default=1.0, ge=0, le=MAX_SECONDS, description="first restart delay; doubles each restart, with jitter"
    )
    backoff_max_s: float = Field(default=60.0, ge=0, le=MAX_SECONDS)
    hang_timeout_s: float | None = Field(
        default=None, gt=0, le=MAX_SECONDS, description="no step for this long = hang; default 2x canary p99, >= floor"
    )
    hang_floor_s: float = Field(default=60.0, gt=0, le=MAX_SECONDS)
    startup_timeout_s: float = Field(
        default=300.0, gt=0, le=MAX_SECONDS, description="launch -> first heartbeat of every rank"
    )
    preempt_grace_s: float = Field(
        default=30.0, ge=0, le=MAX_SECONDS, description="SIGTERM -> SIGKILL, for the emergency checkpoint"
    )
    oom_halve_batch: bool = Field(default=False, description="on OOM retry with half the micro-batch, 2x grad_accum")
    checkpoint_check_s: float = Field(
        default=10.0, gt=0, le=MAX_SECONDS, description="how often to look for a stale checkpoint"
    )
    warm_restarts: bool | None = Field(
        default=None,
        description="fork workers from a pre-imported zygote (traingate.runtime.warm): skips ~3 s of imports "
        "per worker start; unset: on for a CPU pool, off for a GPU pool (checked on CPU only)",
    )


class TrackingSpec(_Section):
    enabled: bool = True
    log_every: int = Field(default=10, ge=1)


class PoolSpec(_Section):
    price_per_gpu_hour: float = Field(ge=0, le=MAX_PRICE_PER_GPU_HOUR)
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
    max_run_usd: float | None = Field(
        default=None,
        ge=0,
        description="the whole run's spend: warned at "
        "alerts.budget_warning.fraction, paused (resumable) when crossed mid-run",
    )


class PromotionSpec(_Section):
    margin: float = Field(
        default=0.0,
        ge=0,
        description="a retrain's model takes @champion only if its val_loss "
        "beats the champion's, on the same held-out data, by more than this",
    )


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
    alerts: AlertsSpec = AlertsSpec()
    pools: dict[str, PoolSpec] = Field(default_factory=_default_pools)
    sweep: SweepSpec | None = Field(default=None, description="hyperparameter sweep (traingate sweep SPEC)")
    promotion: PromotionSpec = PromotionSpec()

    @field_validator("pools")
    @classmethod
    def _pool_names(cls, pools: dict[str, PoolSpec]) -> dict[str, PoolSpec]:
        for name in pools:
            try:
                check_name(name)
            except ValueError as e:
                raise ValueError(f"pool name {name!r}: {e}") from None  # a work pool and a Prefect limit name
        return pools

    @model_validator(mode="after")
    def _urls(self) -> RunSpec:
        # Where a value is sent: a malformed one would fail only when the alert fires or the data is read.
        checks: list[tuple[str, str | None, set[str] | None]] = [
            ("alerts.webhook_url", self.alerts.webhook_url, {"http", "https"})
        ]
        if self.data.uri and "://" in self.data.uri:
            checks.append(("data.uri", self.data.uri, None))
        if self.checkpoint.uri and "://" in self.checkpoint.uri:
            checks.append(("checkpoint.uri", self.checkpoint.uri, None))
        for field, value, schemes in checks:
            if value is not None and (why := url_problem(value, schemes)):
                raise ValueError(f"{field} = {redact(value)!r}: {why}")
        return self

    @model_validator(mode="after")
    def _pool_is_known(self) -> RunSpec:
        if self.resources.work_pool not in self.pools:
            raise ValueError(
                f"resources.work_pool {self.resources.work_pool!r} is not a known pool; "
                f"use one of {sorted(self.pools)} or add it under `pools:`"
            )
        pool = self.pools[self.resources.work_pool]
        if pool.gpus_per_node and self.resources.procs_per_node > pool.gpus_per_node:
            raise ValueError(
                f"resources.procs_per_node {self.resources.procs_per_node} exceeds the "
                f"{pool.gpus_per_node} GPUs per node of pool {self.resources.work_pool!r}; lower it"
            )
        return self

    @property
    def pool(self) -> PoolSpec:
        return self.pools[self.resources.work_pool]

    @property
    def warm_restarts(self) -> bool:
        """``supervision.warm_restarts`` as it applies to this spec's pool: unset, on for a CPU pool and off for a
        GPU pool (a zygote imports torch before it forks; CUDA after such a fork is not checked here)."""
        given = self.supervision.warm_restarts
        return self.pool.gpus_per_node == 0 if given is None else given

    @property
    def world_size(self) -> int:
        return self.resources.nodes * self.resources.procs_per_node

    def gate(self, stage: str) -> GateSpec:
        given = next((g for s, g in self.gates.items() if s == stage), None)
        return given or default_gate(stage, script=self.recipe.name == "script")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def with_overrides(self, overrides: list[str]) -> RunSpec:
        """This spec with ``overrides`` (``path=value`` items, as ``--set`` takes them) applied and validated again:
        a bad item raises :class:`SpecError` naming it."""
        return parse_spec(apply_overrides(self.to_dict(), list(overrides)))

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

# The tags YAML gives plain data implicitly; an explicit other tag (`!!python/...`, `!!binary`,
# `!custom`) would construct something the spec cannot hold, or is refused only by the loader.
_PLAIN_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "map", "seq", "timestamp")}
_MERGE_TAG = "tag:yaml.org,2002:merge"
# More values than any spec has: aliases of aliases could otherwise expand exponentially.
MAX_VALUES = 100_000
MAX_SPEC_BYTES = 1 << 20
# Deeper than any spec nests (sweep.space.<path>.when.<path> is 5 levels): the YAML composer, pydantic's
# serializer and every tree walk recurse once per level and fail with a traceback a few hundred levels down.
MAX_DEPTH = 32


def _too_deep(path: str, where: str) -> SpecError:
    return SpecError(
        f"{path or 'spec'}: {where} nests more than {MAX_DEPTH} levels deep; no spec field holds "
        "that, so flatten the value"
    )


class _DepthLimitedLoader(yaml.SafeLoader):
    """SafeLoader that refuses nesting deeper than MAX_DEPTH while composing (it recurses per level)."""

    def __init__(self, stream: str, where: str, prefix: str) -> None:
        super().__init__(stream)
        self._where = where
        self._path = [prefix] if prefix else []

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        if parent is None:
            return super().compose_node(parent, index)
        part = index.value if isinstance(index, yaml.ScalarNode) else "<key>" if index is None else str(index)
        self._path.append(str(part))
        try:
            if len(self._path) > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise _too_deep(
                    ".".join(self._path[:4]) + ("..." if len(self._path) > 4 else ""),
                    f"{self._where} line {mark.line + 1}",
                )
            return super().compose_node(parent, index)
        finally:
            self._path.pop()


def _node_path(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _check_nodes(root: yaml.Node, where: str, prefix: str = "") -> None:
    """Refuse what safe_load would accept silently: duplicate keys (the last won), tags, alias bombs."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def line(node: yaml.Node) -> str:
        return f"{where} line {node.start_mark.line + 1}"

    def walk(node: yaml.Node, path: str) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in active:
            raise SpecError(
                f"{path or 'spec'}: {line(node)} refers to itself through a YAML alias; write the value out"
            )
        if node.tag not in _PLAIN_TAGS and node.tag != _MERGE_TAG:
            raise SpecError(
                f"{path or 'spec'} = {node.tag!r}: YAML tags are not allowed in a spec ({line(node)}); "
                "remove the tag and write a plain value"
            )
        active.add(id(node))
        size = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, yaml.Node] = {}
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE_TAG:
                    size += walk(value_node, path)
                    continue
                if not isinstance(key_node, yaml.ScalarNode):
                    raise SpecError(
                        f"{path or 'spec'}: {line(key_node)} has a list or mapping as a key; keys must be plain names"
                    )
                key = key_node.value
                sub = _node_path(path, key)
                if key in seen:
                    raise SpecError(
                        f"{sub} = {_scalar(value_node)}: duplicate key ({line(key_node)}, first on line "
                        f"{seen[key].start_mark.line + 1}); YAML keeps only the last one, so keep one"
                    )
                seen[key] = key_node
                size += walk(key_node, sub) + walk(value_node, sub)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                size += walk(item, _node_path(path, str(i)))
        active.discard(id(node))
        sizes[id(node)] = size
        if size > MAX_VALUES:
            raise SpecError(
                f"{path or 'spec'}: expands to more than {MAX_VALUES} values through YAML aliases "
                f"({line(node)}); write the values out"
            )
        return size

    walk(root, prefix)


def _scalar(node: yaml.Node) -> str:
    text = (
        repr(node.value)
        if isinstance(node, yaml.ScalarNode)
        else ("{...}" if isinstance(node, yaml.MappingNode) else "[...]")
    )
    return text if len(text) <= 80 else text[:77] + "..."


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _load_yaml(text: str, where: str, prefix: str = "") -> Any:
    """``yaml.safe_load`` that refuses duplicate keys, tags and alias bombs, naming the field."""
    loader = None
    try:
        loader = _DepthLimitedLoader(text, where, prefix)
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(node, where, prefix)
        return loader.construct_document(node)
    except yaml.reader.ReaderError as e:
        # Raised before parsing, so no field is known yet: show the line that holds the character.
        n = text.count("\n", 0, e.position)
        raise SpecError(
            f"{where} line {n + 1} ({_shown(text.splitlines()[n] if text.splitlines() else text)}) has the "
            f"character {chr(e.character)!r}, which YAML does not allow; remove it"
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" line {mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError(f"{where}{at} is not valid YAML ({problem}); fix the syntax or quote the value") from None
    finally:
        if loader is not None:
            loader.dispose()


def _parse_value(raw: str, key: str = "") -> Any:
    # YAML scalars: `3e-4` -> float, `true` -> bool, `[a, b]` -> list, `x` -> str.
    value = _load_yaml(raw, f"--set {key}={_shown(raw)}" if key else _shown(raw), key) if raw.strip() else ""
    if isinstance(value, str) and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+", value.strip()):
        return float(value)  # YAML 1.1 reads `3e-4` as a string
    return value


def _child_key(node: dict[str, Any], parts: list[str]) -> int:
    """How many parts name the next key: sweep.space keys are themselves dotted (`optim.lr`)."""
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in node:
            return n
    return 1


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides in order to a nested dict (in place).

    Each key may be set once: setting it twice (or a section and a key inside it) would
    silently keep only the last value.
    """
    keys: list[str] = []
    for item in overrides:
        if "=" not in item:
            raise SpecError(f"--set {item!r}: expected key=value, e.g. --set optim.lr=0.001")
        key, raw = item.split("=", 1)
        key = key.strip()
        parts = key.split(".")
        if not all(parts):
            raise SpecError(f"--set {item!r}: empty key part in {key!r}; write dotted keys like optim.lr")
        for k in keys:
            if k == key or k.startswith(key + ".") or key.startswith(k + "."):
                raise SpecError(
                    f"--set {key}={_shown(raw)}: {k} is already set by an earlier --set, and only the last "
                    "would count; set each key once"
                )
        keys.append(key)
        value = _parse_value(raw, key)
        node, done = tree, []
        while True:
            n = _child_key(node, parts)
            name, parts = ".".join(parts[:n]), parts[n:]
            done.append(name)
            if not parts:
                break
            child = node.get(name)
            if child is None:
                child = node[name] = {}
            if isinstance(child, list):
                raise SpecError(
                    f"--set {key}={_shown(raw)}: {'.'.join(done)} is a list, and --set cannot address list "
                    f"items; set the whole list, e.g. --set '{'.'.join(done)}=[...]'"
                )
            if not isinstance(child, dict):
                raise SpecError(
                    f"--set {key}={_shown(raw)}: {'.'.join(done)} is a value ({_shown(child)}), not a section; "
                    f"set {'.'.join(done)} itself"
                )
            node = child
        node[name] = value
    return tree


def _check_values(node: Any, path: str = "", depth: int = 0) -> None:
    """Values no field can hold: non-finite floats, integers beyond 64 bits, NUL characters, deep nesting."""
    here = path or "spec"
    if depth > MAX_DEPTH:
        raise _too_deep(".".join(path.split(".")[:4]) + "...", "the value")
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(k, str) and "\x00" in k:
                raise SpecError(f"{_node_path(path, repr(k))}: key contains a NUL character; remove it")
            _check_values(v, _node_path(path, str(k)), depth + 1)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_values(v, _node_path(path, str(i)), depth + 1)
    elif isinstance(node, float) and not math.isfinite(node):
        raise SpecError(
            f"{here} = {node!r}: not a finite number (inf, nan, or a literal like 1e400 that overflows); "
            "give a finite value"
        )
    elif isinstance(node, int) and not isinstance(node, bool) and not -(2**63) <= node < 2**63:
        raise SpecError(
            f"{here} = {node}: does not fit in 64 bits (torch, numpy and the stores cannot hold it); "
            "give a smaller number"
        )
    elif isinstance(node, str) and "\x00" in node:
        raise SpecError(
            f"{here} = {_shown(node)}: contains a NUL character, which no path, name or command can hold; remove it"
        )


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
    "string_too_long": "shorten it",
    "finite_number": "give a finite number",
    "string_pattern_mismatch": "fix the value",
}


_BOUNDS = {
    "greater_than_equal": ("ge", ">="),
    "greater_than": ("gt", ">"),
    "less_than_equal": ("le", "<="),
    "less_than": ("lt", "<"),
}


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
        raise SpecError(
            f"spec: top level must be a mapping of sections, got {type(tree).__name__}; see examples/digits.yaml"
        )
    _check_values(tree)
    try:
        return RunSpec.model_validate(tree)
    except ValidationError as e:
        raise SpecError(_one_line(e)) from None


def load_spec_text(text: str, overrides: list[str] | None = None, source: str = "<spec>") -> RunSpec:
    tree = _load_yaml(text, source)
    tree = {} if tree is None else tree
    if isinstance(tree, dict):
        apply_overrides(tree, overrides or [])
    return parse_spec(tree)


def load_spec(path: str | Path, overrides: list[str] | None = None) -> RunSpec:
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"spec file {str(path)!r} does not exist; pass the path of a YAML spec")
    try:
        if p.stat().st_size > MAX_SPEC_BYTES:
            raise SpecError(
                f"spec file {str(path)!r} is {p.stat().st_size} bytes; a spec is at most "
                f"{MAX_SPEC_BYTES} bytes of YAML, pass the right file"
            )
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"spec file {str(path)!r} is not UTF-8 text (byte {e.start}); pass a YAML file") from None
    except OSError as e:
        raise SpecError(f"spec file {str(path)!r} cannot be read ({e.strerror}); fix its permissions") from None
    spec = load_spec_text(text, overrides, source=f"spec file {str(path)!r}")
    script = spec.recipe.script
    if script is not None and not Path(script.workdir).is_absolute():
        # A script's workdir is relative to the spec file, so a spec works from any cwd.
        script.workdir = str((p.resolve().parent / script.workdir).resolve())
    return spec


def write_resolved(spec: RunSpec, path: str | Path) -> Path:
    """Write the resolved spec (every default filled in) where a training process can read it."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.dump(spec.to_dict(), Dumper=_SAFE_DUMPER, sort_keys=False))
    return p


# libyaml's emitter where PyYAML has it (its wheels do): the same text as the pure-Python one, 4x faster.
_SAFE_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
