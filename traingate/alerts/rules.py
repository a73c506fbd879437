"""Alert rules: pure functions from metric series to a firing, or None.

A series is a sequence of ``(x, value)`` points: x is the global step for per-step signals
(loss, gradient norm, step time, data-loader wait) and epoch seconds for timed ones (GPU
utilisation, heartbeats, spend). A rule looks at the whole series it is given and reports the
FIRST point at which its condition held (``Firing.at``), so a caller that polls a growing series
sees the same firing again and can drop it by ``(rule, at)``. Rules about time passing
(no checkpoint, GPU idle, no progress) also take ``now``.

Each rule has its defaults, severity and action in :class:`AlertsSpec`; each firing's message
is one line that names the numbers and the runbook section (``docs/runbooks.md#<rule>``).
Nothing here carries an action out: the caller does (notify, pause, stop, roll back, quarantine).

>>> spec = AlertsSpec()
>>> loss = [(s, 2.0 / s ** 0.5) for s in range(1, 80)] + [(s, 3.0) for s in range(80, 84)]
>>> f = loss_spike(loss, spec.loss_spike)
>>> f.rule, str(f.action), f.at
(<Rule.LOSS_SPIKE: 'loss-spike'>, 'rollback', 80)
>>> loss_spike(loss[:-3], spec.loss_spike) is None  # one high point is one noisy batch
True
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from traingate.specbase import SpecModel

RUNBOOK = "docs/runbooks.md"

Point = tuple[float, float]
Series = Sequence[Point]


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class Action(StrEnum):
    NOTIFY = "notify"  # tell someone; the run goes on
    PAUSE = "pause"  # checkpoint and stop; `traingate resume` continues it
    STOP = "stop"  # stop for good
    ROLLBACK = "rollback"  # back to the last good checkpoint before the event, continue with mitigation
    QUARANTINE = "quarantine"  # leave the offending rank's host out of the next launch


class Rule(StrEnum):
    """Every alert; the value is its section anchor in docs/runbooks.md."""

    NONFINITE_LOSS = "nonfinite-loss"
    LOSS_SPIKE = "loss-spike"
    STAGNATION = "stagnation"
    VAL_NOT_IMPROVED = "val-not-improved"
    GRAD_NORM_EXPLOSION = "grad-norm-explosion"
    STEP_TIME_REGRESSION = "step-time-regression"
    STRAGGLER = "straggler"
    GPU_UNDERUTILISED = "gpu-underutilised"
    DATA_LOADER_STALL = "data-loader-stall"
    CHECKPOINT_STALE = "checkpoint-stale"
    RESTART_STORM = "restart-storm"
    BUDGET_WARNING = "budget-warning"
    BUDGET_EXHAUSTED = "budget-exhausted"
    NO_PROGRESS = "no-progress"


@dataclass(frozen=True)
class Firing:
    rule: Rule
    severity: Severity
    action: Action
    at: float  # the x (step or epoch seconds) at which the condition first held
    message: str  # one line: the numbers, then the runbook section
    values: dict[str, float] = field(default_factory=dict)  # the same numbers, for metrics and event payloads

    @property
    def runbook(self) -> str:
        return f"{RUNBOOK}#{self.rule.value}"


# ---------------------------------------------------------------- the spec

_ALL_ACTIONS = frozenset(Action)
# Rolling back only helps when the training state itself went bad; quarantine needs a rank to blame.
_STATE_ACTIONS = frozenset({Action.NOTIFY, Action.PAUSE, Action.STOP, Action.ROLLBACK})
_RUN_ACTIONS = frozenset({Action.NOTIFY, Action.PAUSE, Action.STOP})


class RuleSpec(SpecModel):
    enabled: bool = True
    severity: Severity = Severity.WARNING
    action: Action = Action.NOTIFY
    allowed_actions: ClassVar[frozenset[Action]] = _RUN_ACTIONS

    @model_validator(mode="after")
    def _action_fits(self) -> RuleSpec:
        if self.action not in self.allowed_actions:
            raise ValueError(
                f"action {self.action.value!r} does not apply to this alert; use one of "
                f"{sorted(a.value for a in self.allowed_actions)}"
            )
        return self


class _StateRuleSpec(RuleSpec):
    """A rule that finds the training state itself gone bad: critical, rolled back by default."""

    severity: Severity = Severity.CRITICAL
    action: Action = Action.ROLLBACK
    allowed_actions: ClassVar[frozenset[Action]] = _STATE_ACTIONS


class NonfiniteLossSpec(_StateRuleSpec):
    # The training loop already skips a non-finite update and stops the stage as diverged past
    # optim.nonfinite_tolerance: by default this alert only tells. `rollback` also skips the batches.
    severity: Severity = Severity.WARNING
    action: Action = Action.NOTIFY


class LossSpikeSpec(_StateRuleSpec):
    # Defaults chosen from recorded clean runs and 3x jumps spliced into them (python -m bench spike,
    # docs/benchmarks.md): one batch's loss swings several x on small batches, a short window follows an
    # early fall, and near zero loss a few x is noise however it is measured: the give-back test is what
    # tells a spike from the late wiggle of a loss that has fallen 100x.
    window: int = Field(default=15, ge=3, description="points before the candidate run that make its baseline")
    min_points: int = Field(
        default=10, ge=3, description="no verdict before this many finite points; their median is the start level"
    )
    steps: int = Field(
        default=6, ge=1, description="the median of this many latest points is tested: one noisy batch is no spike"
    )
    ratio: float = Field(default=2.0, gt=1, description="that median is at least this x the baseline's median")
    min_give_back: float = Field(
        default=0.1,
        ge=0,
        description="and gives back at least this fraction of the fall from the start level to the baseline",
    )


class StagnationSpec(RuleSpec):
    window: int = Field(
        default=200, ge=2, description="points per window; the last window is compared with the one before it"
    )
    min_improvement: float = Field(default=0.01, ge=0, description="relative fall of the median loss")


class ValNotImprovedSpec(RuleSpec):
    patience: int = Field(default=5, ge=1, description="evaluations since the best one")
    mode: Literal["min", "max"] = "min"
    min_delta: float = Field(default=0.0, ge=0, description="an improvement smaller than this does not count")


class GradNormExplosionSpec(_StateRuleSpec):
    window: int = Field(default=50, ge=5)
    min_points: int = Field(default=10, ge=3)
    factor: float = Field(default=10.0, gt=1, description="x the median of the window before it")


class StepTimeRegressionSpec(RuleSpec):
    skip: int = Field(default=5, ge=0, description="warm-up steps left out of the baseline")
    baseline: int = Field(default=50, ge=3, description="steps after the warm-up that make the baseline")
    recent: int = Field(default=50, ge=3, description="latest steps compared with the baseline")
    max_increase: float = Field(default=0.2, gt=0, description="median step time this fraction above baseline")


class StragglerSpec(RuleSpec):
    slower_by: float = Field(default=0.2, gt=0, description="fraction above the other ranks' median")
    window: int = Field(default=50, ge=3, description="latest steps every rank reported")
    share: float = Field(default=0.8, gt=0, le=1, description="of those steps the rank was slower in")
    action: Action = Action.QUARANTINE
    allowed_actions: ClassVar[frozenset[Action]] = _RUN_ACTIONS | {Action.QUARANTINE}


class GpuUnderutilisedSpec(RuleSpec):
    below_percent: float = Field(default=50.0, gt=0, le=100)
    for_s: float = Field(default=600.0, gt=0)


class DataLoaderStallSpec(RuleSpec):
    max_share: float = Field(default=0.2, gt=0, le=1, description="of step time spent waiting for data")
    window: int = Field(default=50, ge=3, description="latest steps")


class CheckpointStaleSpec(RuleSpec):
    factor: float = Field(default=2.0, ge=1, description="x the checkpoint interval")


class RestartStormSpec(RuleSpec):
    count: int = Field(default=3, ge=2, description="restarts ...")
    within_s: float = Field(default=600.0, gt=0, description="... within this many seconds")
    severity: Severity = Severity.CRITICAL
    # The retry budget (supervision.max_restarts, max_downtime_s) is what ends a crash loop; by default
    # this alert tells a human, so a budget of 7 restarts still means 7. `pause` stops at the storm.
    action: Action = Action.NOTIFY
    allowed_actions: ClassVar[frozenset[Action]] = _RUN_ACTIONS | {Action.QUARANTINE}


class BudgetWarningSpec(RuleSpec):
    fraction: float = Field(default=0.8, gt=0, le=1)


class BudgetExhaustedSpec(RuleSpec):
    fraction: float = Field(default=1.0, gt=0)
    severity: Severity = Severity.CRITICAL
    action: Action = Action.PAUSE


class NoProgressSpec(RuleSpec):
    for_s: float = Field(default=900.0, gt=0, description="no new highest step for this long")
    alive_s: float = Field(default=120.0, gt=0, description="while a heartbeat is at most this old")
    severity: Severity = Severity.CRITICAL
    action: Action = Action.PAUSE


class RollbackSpec(SpecModel):
    """What a roll-back does besides going back to the last checkpoint before the event."""

    skip_batches: bool = Field(
        default=True, description="skip the batches from that checkpoint up to and including the offending step"
    )
    lr_scale: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="multiply the learning rate by this from the roll-back on (compounds over roll-backs)",
    )
    max_rollbacks: int = Field(default=3, ge=0, description="per stage; one more firing pauses the run instead")


class AlertsSpec(SpecModel):
    """The spec's ``alerts:`` section: every rule's thresholds, severity and action, and how a roll-back
    mitigates. The supervisor evaluates them about once a second while a stage trains."""

    enabled: bool = True
    every_s: float = Field(default=1.0, gt=0, le=60, description="how often the supervisor evaluates the rules")
    webhook_url: str | None = Field(
        default=None,
        description="POST every alert here as JSON (Slack-compatible "
        "`text`); a URL with a token belongs in the environment: ${env:NAME}",
    )
    rollback: RollbackSpec = RollbackSpec()
    nonfinite_loss: NonfiniteLossSpec = NonfiniteLossSpec()
    loss_spike: LossSpikeSpec = LossSpikeSpec()
    stagnation: StagnationSpec = StagnationSpec()
    val_not_improved: ValNotImprovedSpec = ValNotImprovedSpec()
    grad_norm_explosion: GradNormExplosionSpec = GradNormExplosionSpec()
    step_time_regression: StepTimeRegressionSpec = StepTimeRegressionSpec()
    straggler: StragglerSpec = StragglerSpec()
    gpu_underutilised: GpuUnderutilisedSpec = GpuUnderutilisedSpec()
    data_loader_stall: DataLoaderStallSpec = DataLoaderStallSpec()
    checkpoint_stale: CheckpointStaleSpec = CheckpointStaleSpec()
    restart_storm: RestartStormSpec = RestartStormSpec()
    budget_warning: BudgetWarningSpec = BudgetWarningSpec()
    budget_exhausted: BudgetExhaustedSpec = BudgetExhaustedSpec()
    no_progress: NoProgressSpec = NoProgressSpec()


# ---------------------------------------------------------------- helpers


def _g(v: float) -> str:
    return f"{v:.4g}"


def _fire(rule: Rule, spec: RuleSpec, at: float, text: str, **values: float) -> Firing:
    return Firing(
        rule,
        spec.severity,
        spec.action,
        at,
        f"{rule.value}: {text} [{spec.action.value}; runbook {RUNBOOK}#{rule.value}]",
        values,
    )


def _finite(points: Series) -> list[Point]:
    return [(x, float(v)) for x, v in points if math.isfinite(float(v))]


def _x(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else _g(x)


def _by_x(points: Series) -> dict[float, float]:
    return {x: float(v) for x, v in points}


# ---------------------------------------------------------------- loss and optimisation


def nonfinite_loss(loss: Series, spec: NonfiniteLossSpec, metric: str = "train_loss") -> Firing | None:
    """The first NaN or infinite loss."""
    if not spec.enabled:
        return None
    for x, v in loss:
        if not math.isfinite(float(v)):
            bad = sum(1 for _, w in loss if not math.isfinite(float(w)))
            return _fire(
                Rule.NONFINITE_LOSS,
                spec,
                x,
                f"{metric} is {float(v)} at step {_x(x)} ({bad} non-finite of {len(loss)} points)",
                step=x,
                nonfinite_points=bad,
            )
    return None


@dataclass(frozen=True)
class Spike:
    """What :func:`spike_of` found: the run's first high point (an index into ``recent``) and the numbers."""

    first: int
    level: float  # median of the latest ``steps`` points
    median: float  # of the baseline before them
    ratio: float
    given_back: float  # fraction of the fall from the start level to the baseline median


def spike_of(head: Sequence[float], recent: Sequence[float], spec: LossSpikeSpec) -> Spike | None:
    """Whether the latest ``spec.steps`` of the finite values ``recent`` are a loss spike; None if not.

    ``head``: the series' first ``min_points`` finite values (their median is the start level);
    ``recent``: its latest values, at least ``steps + min(window, min_points)`` of them for a verdict.
    The baseline is the median of the ``window`` values before the latest ``steps``. A spike: the
    median of the latest ``steps`` is ``ratio`` x the baseline and gives back at least ``min_give_back``
    of what the loss fell from the start level to the baseline. The one test :func:`loss_spike` applies to
    each point, and the training process (``traingate.runtime.spike_guard``) to each step.

    >>> spec = LossSpikeSpec()
    >>> flat = [2.0] * 10 + [1.0] * 15
    >>> spike_of(flat[:10], flat + [1.0, 3.0, 3.0, 2.9, 3.1, 3.0], spec)
    Spike(first=26, level=3.0, median=1.0, ratio=3.0, given_back=2.0)
    >>> spike_of(flat[:10], flat + [1.0, 1.0, 9.0, 1.0, 1.0, 1.0], spec) is None  # one batch
    True
    """
    k = spec.steps
    if len(head) < spec.min_points or len(recent) < k + min(spec.window, spec.min_points):
        return None
    base = recent[-(k + spec.window) : -k]
    med = statistics.median(base)
    run = recent[-k:]
    level = statistics.median(run)
    floor = med + (spec.ratio - 1) * abs(med)
    if level < floor:
        return None
    start = statistics.median(head[: spec.min_points])
    fell = start - med
    given_back = (level - med) / fell if fell > 0 else math.inf
    if given_back < spec.min_give_back:
        return None
    # The run's first point at the spike's level: where it began, for the checkpoint to roll back to.
    cut = max(floor, med + spec.min_give_back * fell)
    first = len(recent) - k + next(i for i, v in enumerate(run) if v >= cut)
    return Spike(first, level, med, level / med if med > 0 else math.inf, given_back)


def loss_spike(loss: Series, spec: LossSpikeSpec, metric: str = "train_loss") -> Firing | None:
    """The first run of ``steps`` finite points that :func:`spike_of` calls a spike; ``at`` is its first high
    point. Non-finite points are the non-finite rule's business and are left out of every baseline."""
    if not spec.enabled:
        return None
    pts = _finite(loss)
    keep = spec.steps + spec.window
    head = [v for _, v in pts[: spec.min_points]]
    for i in range(len(pts)):
        lo = max(0, i + 1 - keep)
        recent = [v for _, v in pts[lo : i + 1]]
        if (found := spike_of(head, recent, spec)) is None:
            continue
        x = pts[lo + found.first][0]
        run = pts[i + 1 - spec.steps : i + 1]
        return _fire(
            Rule.LOSS_SPIKE,
            spec,
            x,
            f"{metric} from step {_x(x)}: median {_g(found.level)} over steps {_x(run[0][0])}-{_x(run[-1][0])} is "
            f"{_g(found.ratio)}x the median {_g(found.median)} of the {len(recent) - spec.steps} points before "
            f"(limit {_g(spec.ratio)}x) and gives back {_g(100 * found.given_back)}% of the fall from the start "
            f"level {_g(statistics.median(head))} (limit {_g(100 * spec.min_give_back)}%)",
            step=x,
            decided_at=run[-1][0],  # the step whose loss completed the run: when a per-step test acts
            value=pts[lo + found.first][1],
            level=found.level,
            median=found.median,
            ratio=found.ratio,
            given_back=found.given_back,
        )
    return None


def stagnation(loss: Series, spec: StagnationSpec, metric: str = "train_loss") -> Firing | None:
    """The median loss of the last ``window`` points fell less than ``min_improvement`` (relative)
    below the median of the ``window`` points before them."""
    if not spec.enabled:
        return None
    pts = _finite(loss)
    if len(pts) < 2 * spec.window:
        return None
    w = spec.window
    before = statistics.median(v for _, v in pts[-2 * w : -w])
    last = statistics.median(v for _, v in pts[-w:])
    gain = (before - last) / abs(before) if before else 0.0
    if gain >= spec.min_improvement:
        return None
    start = pts[-w][0]
    return _fire(
        Rule.STAGNATION,
        spec,
        start,
        f"median {metric} {_g(last)} over steps {_x(start)}-{_x(pts[-1][0])} is {_g(100 * gain)}% below "
        f"the {_g(before)} of the {w} points before (needs >= {_g(100 * spec.min_improvement)}%)",
        median_before=before,
        median_last=last,
        improvement=gain,
    )


def val_not_improved(val: Series, spec: ValNotImprovedSpec, metric: str = "val_loss") -> Firing | None:
    """The best evaluation is ``patience`` or more evaluations old."""
    if not spec.enabled:
        return None
    pts = _finite(val)
    if not pts:
        return None
    sign = 1.0 if spec.mode == "min" else -1.0
    best_i = 0
    for i, (_, v) in enumerate(pts):
        if sign * (pts[best_i][1] - v) > spec.min_delta:
            best_i = i
        if i - best_i >= spec.patience:
            bx, bv = pts[best_i]
            return _fire(
                Rule.VAL_NOT_IMPROVED,
                spec,
                pts[i][0],
                f"{metric} has not improved for {i - best_i} evaluations (patience {spec.patience}): "
                f"best {_g(bv)} at step {_x(bx)}, latest {_g(v)} at step {_x(pts[i][0])}",
                best=bv,
                best_step=bx,
                latest=v,
                evaluations=i - best_i,
            )
    return None


def grad_norm_explosion(grad_norm: Series, spec: GradNormExplosionSpec, metric: str = "grad_norm") -> Firing | None:
    """The first gradient norm that is non-finite or ``factor`` x the median of the window before it."""
    if not spec.enabled:
        return None
    history: list[float] = []
    for x, v in grad_norm:
        v = float(v)
        if not math.isfinite(v):
            return _fire(Rule.GRAD_NORM_EXPLOSION, spec, x, f"{metric} is {v} at step {_x(x)}", step=x)
        if len(history) >= spec.min_points:
            med = statistics.median(history[-spec.window :])
            if v > spec.factor * med:
                return _fire(
                    Rule.GRAD_NORM_EXPLOSION,
                    spec,
                    x,
                    f"{metric} {_g(v)} at step {_x(x)} is {_g(v / med if med else math.inf)}x the median "
                    f"{_g(med)} of the steps before it (threshold {_g(spec.factor)}x)",
                    step=x,
                    value=v,
                    median=med,
                )
        history.append(v)
    return None


# ---------------------------------------------------------------- throughput


def step_time_regression(step_time: Series, spec: StepTimeRegressionSpec, metric: str = "step_time_s") -> Firing | None:
    """The median of the latest ``recent`` step times is more than ``max_increase`` above the run's own
    baseline: the median of the ``baseline`` steps after the first ``skip``."""
    if not spec.enabled:
        return None
    pts = _finite(step_time)
    if len(pts) < spec.skip + spec.baseline + spec.recent:
        return None
    base = statistics.median(v for _, v in pts[spec.skip : spec.skip + spec.baseline])
    recent = statistics.median(v for _, v in pts[-spec.recent :])
    if base <= 0 or recent <= base * (1 + spec.max_increase):
        return None
    start = pts[-spec.recent][0]
    return _fire(
        Rule.STEP_TIME_REGRESSION,
        spec,
        start,
        f"median {metric} {_g(recent)} s over steps {_x(start)}-{_x(pts[-1][0])} is "
        f"{_g(100 * (recent / base - 1))}% above the run's baseline {_g(base)} s "
        f"(steps {_x(pts[spec.skip][0])}-{_x(pts[spec.skip + spec.baseline - 1][0])}; "
        f"limit +{_g(100 * spec.max_increase)}%)",
        baseline=base,
        recent=recent,
        increase=recent / base - 1,
    )


def straggler(rank_step_times: Mapping[int, Series], spec: StragglerSpec) -> Firing | None:
    """A rank slower than ``slower_by`` above the median of the other ranks in at least ``share`` of the
    latest ``window`` steps that every rank reported. The slowest such rank is named."""
    if not spec.enabled or len(rank_step_times) < 2:
        return None
    by_rank = {r: _by_x(s) for r, s in rank_step_times.items()}
    common = sorted(set.intersection(*(set(d) for d in by_rank.values())))
    steps = common[-spec.window :]
    if len(steps) < spec.window:
        return None
    worst: tuple[float, int, float] | None = None
    for r, times in by_rank.items():
        slow, ratios = 0, []
        for s in steps:
            others = statistics.median(by_rank[o][s] for o in by_rank if o != r)
            ratio = times[s] / others if others > 0 else math.inf
            ratios.append(ratio)
            slow += ratio > 1 + spec.slower_by
        frac = slow / len(steps)
        if frac >= spec.share and (worst is None or frac > worst[0]):
            worst = (frac, r, statistics.median(ratios))
    if worst is None:
        return None
    frac, r, ratio = worst
    return _fire(
        Rule.STRAGGLER,
        spec,
        steps[0],
        f"rank {r} was more than {_g(100 * spec.slower_by)}% slower than the other ranks' median in "
        f"{_g(100 * frac)}% of steps {_x(steps[0])}-{_x(steps[-1])} (median ratio {_g(ratio)}x; "
        f"threshold {_g(100 * spec.share)}%)",
        rank=r,
        share=frac,
        ratio=ratio,
    )


def gpu_underutilised(
    util: Series, spec: GpuUnderutilisedSpec, now: float, metric: str = "gpu_util_percent"
) -> Firing | None:
    """Every GPU-utilisation sample for the last ``for_s`` seconds is below ``below_percent``.
    An empty series (no GPU, NVML absent) never fires."""
    if not spec.enabled:
        return None
    pts = _finite(util)
    if not pts or pts[-1][1] >= spec.below_percent:
        return None
    i = len(pts) - 1
    while i > 0 and pts[i - 1][1] < spec.below_percent:
        i -= 1
    # Low since the last good sample (util was fine then), or since the first sample if none was.
    since = pts[i - 1][0] if i > 0 else pts[0][0]
    if now - since < spec.for_s:
        return None
    low = [v for _, v in pts[i:]]
    return _fire(
        Rule.GPU_UNDERUTILISED,
        spec,
        since,
        f"{metric} below {_g(spec.below_percent)}% for {_g(now - since)} s "
        f"(mean {_g(statistics.fmean(low))}%, {len(low)} samples; threshold {_g(spec.for_s)} s)",
        seconds=now - since,
        mean_percent=statistics.fmean(low),
    )


def data_loader_stall(data_wait: Series, step_time: Series, spec: DataLoaderStallSpec) -> Firing | None:
    """Over the latest ``window`` steps, time waiting for data is more than ``max_share`` of step time."""
    if not spec.enabled:
        return None
    wait, total = _by_x(_finite(data_wait)), _by_x(_finite(step_time))
    steps = sorted(set(wait) & set(total))[-spec.window :]
    if len(steps) < spec.window:
        return None
    spent = sum(total[s] for s in steps)
    share = sum(wait[s] for s in steps) / spent if spent > 0 else 0.0
    if share <= spec.max_share:
        return None
    return _fire(
        Rule.DATA_LOADER_STALL,
        spec,
        steps[0],
        f"{_g(100 * share)}% of step time over steps {_x(steps[0])}-{_x(steps[-1])} was spent waiting "
        f"for data (limit {_g(100 * spec.max_share)}%)",
        share=share,
    )


# ---------------------------------------------------------------- run health


def checkpoint_interval_s(every_steps: int | None, every_s: float | None, step_time_s: float | None) -> float | None:
    """The expected time between checkpoints: the sooner of the step and the time trigger (None: neither).

    >>> checkpoint_interval_s(50, 600.0, 2.0), checkpoint_interval_s(50, None, None)
    (100.0, None)
    """
    candidates = [every_s] if every_s else []
    if every_steps and step_time_s:
        candidates.append(every_steps * step_time_s)
    return min(candidates) if candidates else None


def checkpoint_stale(
    checkpoint_times: Sequence[float], started_at: float, interval_s: float, spec: CheckpointStaleSpec, now: float
) -> Firing | None:
    """No checkpoint completed within ``factor`` x the interval, counting from the newest one or from this
    launch (a resumed process's older checkpoints do not make it late)."""
    if not spec.enabled or interval_s <= 0:
        return None
    last = max([started_at, *checkpoint_times])
    age = now - last
    if age <= spec.factor * interval_s:
        return None
    what = "the last checkpoint" if checkpoint_times and last > started_at else "the launch (no checkpoint since)"
    return _fire(
        Rule.CHECKPOINT_STALE,
        spec,
        last,
        f"{_g(age)} s since {what}; expected one every {_g(interval_s)} s "
        f"(limit {_g(spec.factor)}x = {_g(spec.factor * interval_s)} s)",
        age_s=age,
        interval_s=interval_s,
    )


def stale_checkpoint(reason: str, step: int, spec: CheckpointStaleSpec) -> Firing:
    """The checkpoint-stale firing of the supervisor's own look at the checkpoint store (every
    supervision.checkpoint_check_s): ``reason`` from :func:`traingate.supervision.heartbeat.checkpoint_stale`,
    at the step rank 0 has reached."""
    return _fire(Rule.CHECKPOINT_STALE, spec, step, reason)


def restart_storm(restart_times: Sequence[float], spec: RestartStormSpec) -> Firing | None:
    """``count`` restarts within ``within_s`` seconds (the first such run of restarts)."""
    if not spec.enabled:
        return None
    ts = sorted(restart_times)
    for i in range(len(ts) - spec.count + 1):
        span = ts[i + spec.count - 1] - ts[i]
        if span <= spec.within_s:
            return _fire(
                Rule.RESTART_STORM,
                spec,
                ts[i + spec.count - 1],
                f"{spec.count} restarts within {_g(span)} s (limit {spec.count} in {_g(spec.within_s)} s; "
                f"{len(ts)} restarts in all)",
                restarts=spec.count,
                span_s=span,
            )
    return None


def _budget(rule: Rule, spend: Series, limit_usd: float, fraction: float, spec: RuleSpec, scope: str) -> Firing | None:
    if not spec.enabled or limit_usd <= 0:
        return None
    for x, v in spend:
        if v >= fraction * limit_usd:
            return _fire(
                rule,
                spec,
                x,
                f"{scope} spent ${_g(v)} of its ${_g(limit_usd)} budget "
                f"({_g(100 * v / limit_usd)}%; threshold {_g(100 * fraction)}%)",
                spent_usd=v,
                budget_usd=limit_usd,
            )
    return None


def budget_warning(spend: Series, limit_usd: float, spec: BudgetWarningSpec, scope: str = "run") -> Firing | None:
    """Cumulative spend (``(time, dollars)``) reached ``fraction`` of the budget. ``scope``: run, sweep, team."""
    return _budget(Rule.BUDGET_WARNING, spend, limit_usd, spec.fraction, spec, scope)


def budget_exhausted(spend: Series, limit_usd: float, spec: BudgetExhaustedSpec, scope: str = "run") -> Firing | None:
    """Cumulative spend reached the budget (``fraction`` 1.0 by default)."""
    return _budget(Rule.BUDGET_EXHAUSTED, spend, limit_usd, spec.fraction, spec, scope)


def no_progress(heartbeats: Series, spec: NoProgressSpec, now: float) -> Firing | None:
    """Heartbeats (``(time, step)``) still arrive but the highest step reached has not grown for ``for_s``:
    a process re-doing the same steps after each restart, or stuck outside its training loop while
    alive. (A process whose heartbeats stopped is the supervisor's hang detector's business.)"""
    if not spec.enabled or not heartbeats:
        return None
    last_beat = max(t for t, _ in heartbeats)
    if now - last_beat > spec.alive_s:
        return None
    high, since = -math.inf, heartbeats[0][0]
    for t, step in sorted(heartbeats):
        if step > high:
            high, since = step, t
    if now - since < spec.for_s:
        return None
    return _fire(
        Rule.NO_PROGRESS,
        spec,
        since,
        f"highest step {_x(high)} reached {_g(now - since)} s ago while the latest heartbeat is "
        f"{_g(now - last_beat)} s old (limit {_g(spec.for_s)} s)",
        step=high,
        seconds=now - since,
    )


# ---------------------------------------------------------------- all at once


@dataclass
class Signals:
    """What a monitor knows about one run at one moment; an empty field means "not measured" and its
    rules do not run."""

    loss: Series = ()
    val: Series = ()
    grad_norm: Series = ()
    step_time: Series = ()
    data_wait: Series = ()
    rank_step_times: Mapping[int, Series] = field(default_factory=dict)
    gpu_util: Series = ()
    checkpoint_times: Sequence[float] = ()
    started_at: float | None = None
    checkpoint_interval_s: float | None = None
    restart_times: Sequence[float] = ()
    spend_usd: Series = ()
    budget_usd: float | None = None
    budget_scope: str = "run"
    heartbeats: Series = ()


def evaluate(signals: Signals, spec: AlertsSpec, now: float) -> list[Firing]:
    """Every rule whose inputs are present, in :class:`Rule` order; the firings."""
    s = signals
    out = [
        nonfinite_loss(s.loss, spec.nonfinite_loss) if s.loss else None,
        loss_spike(s.loss, spec.loss_spike) if s.loss else None,
        stagnation(s.loss, spec.stagnation) if s.loss else None,
        val_not_improved(s.val, spec.val_not_improved) if s.val else None,
        grad_norm_explosion(s.grad_norm, spec.grad_norm_explosion) if s.grad_norm else None,
        step_time_regression(s.step_time, spec.step_time_regression) if s.step_time else None,
        straggler(s.rank_step_times, spec.straggler) if s.rank_step_times else None,
        gpu_underutilised(s.gpu_util, spec.gpu_underutilised, now) if s.gpu_util else None,
        data_loader_stall(s.data_wait, s.step_time, spec.data_loader_stall) if s.data_wait and s.step_time else None,
        checkpoint_stale(s.checkpoint_times, s.started_at, s.checkpoint_interval_s, spec.checkpoint_stale, now)
        if s.started_at is not None and s.checkpoint_interval_s
        else None,
        restart_storm(s.restart_times, spec.restart_storm) if s.restart_times else None,
        budget_warning(s.spend_usd, s.budget_usd, spec.budget_warning, s.budget_scope)
        if s.spend_usd and s.budget_usd is not None
        else None,
        budget_exhausted(s.spend_usd, s.budget_usd, spec.budget_exhausted, s.budget_scope)
        if s.spend_usd and s.budget_usd is not None
        else None,
        no_progress(s.heartbeats, spec.no_progress, now) if s.heartbeats else None,
    ]
    return [f for f in out if f is not None]
