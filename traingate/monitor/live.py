"""The supervisor's monitor: the alert rules over a running stage, about once a second.

It follows what the training processes write into the stage directory (rank 0's
``metrics.jsonl``, ``progress.jsonl``, every rank's heartbeat) and what the supervisor
knows (restarts, time held, price), keeps a bounded window of each series, and runs
:func:`traingate.alerts.rules.evaluate` over them. It returns each alert once:

- an *event* rule (non-finite loss, loss spike, gradient-norm explosion, restart storm) fires
  once per event, named by the step (or time) it happened at. A rule names the first event in the
  window it is given (the last few hundred steps), so the steps after a spike, still high against
  the baseline before it, are not each a new alert; a second, separate spike in the same window is
  raised once the first has left it (with ``notify``; a roll-back or pause ends the window anyway);
- a *condition* rule (stagnation, slow steps, straggler, stalls, budget, no progress) fires when
  its condition starts to hold and again only after it stopped holding.

After a roll-back the series are cut back to the checkpoint the stage resumes from: what the
rolled-back steps showed is no longer the run's history.

Nothing here acts; the supervisor does (:mod:`traingate.supervision.supervisor`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from traingate.alerts.rules import AlertsSpec, Firing, Rule, Signals, evaluate
from traingate.job import files

EVENT_RULES = frozenset({Rule.NONFINITE_LOSS, Rule.LOSS_SPIKE, Rule.GRAD_NORM_EXPLOSION, Rule.RESTART_STORM})
RANK_HISTORY = 256  # steps of per-rank times kept for the straggler rule


class StageMonitor:
    def __init__(
        self,
        spec: AlertsSpec,
        stage_dir: Path,
        slots: int,
        price_per_slot_hour: float,
        budget_usd: float | None = None,
        spent_before_usd: float = 0.0,
        budget_scope: str = "run",
        started_at: float = 0.0,
    ):
        self.spec = spec
        self.stage_dir = Path(stage_dir)
        self.usd_per_s = slots * price_per_slot_hour / 3600.0
        self.budget_usd, self.spent_before, self.scope = budget_usd, spent_before_usd, budget_scope
        self.started_at = started_at
        n = 50 + max(
            2 * spec.stagnation.window,
            spec.loss_spike.window + 200,
            spec.grad_norm_explosion.window + 200,
            spec.data_loader_stall.window,
            spec.step_time_regression.recent,
        )
        self.loss: deque[tuple[float, float]] = deque(maxlen=n)
        self.loss_head: list[tuple[float, float]] = []  # the stage's first losses: the spike rule's start level
        self.grad: deque[tuple[float, float]] = deque(maxlen=n)
        self.step_time: deque[tuple[float, float]] = deque(maxlen=n)
        self.data_wait: deque[tuple[float, float]] = deque(maxlen=n)
        st = spec.step_time_regression
        self.step_time_head: list[tuple[float, float]] = []  # the stage's first steps: its own baseline
        self.head_len = st.skip + st.baseline
        self.val: list[tuple[float, float]] = []
        self.val_metric = "val_loss"
        self.ranks: dict[int, dict[int, float]] = {}
        self.beats: deque[tuple[float, float]] = deque(maxlen=4096)
        self.gpu_util: deque[tuple[float, float]] = deque(maxlen=4096)  # (time, percent): the idle-GPU rule
        self.spend: deque[tuple[float, float]] = deque(maxlen=2)
        self.metrics = files.Follower(self.stage_dir / files.METRICS)
        self.progress = files.ProgressFollower(self.stage_dir)
        self.min_attempt = 0
        # Events this stage already alerted on (an earlier supervision: smoke's first half, a paused run
        # being resumed) are not alerted on again when their lines are read back.
        self.seen: set[tuple[Rule, float]] = {
            (Rule(a.rule), float(a.at)) for a in files.read_alerts(self.stage_dir) if a.rule in EVENT_RULES
        }
        self.active: set[Rule] = set()
        self.next_eval = 0.0

    # ---------------------------------------------------------------- inputs
    def _read(self) -> None:
        for d in self.metrics.new():
            if int(d.get("attempt", 0)) < self.min_attempt:
                continue  # a rolled-back attempt's last lines
            x = float(d["step"])
            self.loss.append((x, float(d["loss"])))
            if len(self.loss_head) < self.spec.loss_spike.min_points and math.isfinite(float(d["loss"])):
                self.loss_head.append((x, float(d["loss"])))
            self.grad.append((x, float(d["grad_norm"])))
            if d.get("step_time_s") is not None:
                self.step_time.append((x, float(d["step_time_s"])))
                if len(self.step_time_head) < self.head_len:
                    self.step_time_head.append((x, float(d["step_time_s"])))
            if d.get("data_wait_s") is not None:
                self.data_wait.append((x, float(d["data_wait_s"])))
            if d.get("gpu_util_percent") is not None and (not self.gpu_util or d["time"] - self.gpu_util[-1][0] >= 1):
                # One sample a second at most: the window must span the rule's 10 minutes.
                self.gpu_util.append((float(d["time"]), float(d["gpu_util_percent"])))
        for d in self.progress.new():
            if self.val_metric in d and isinstance(d[self.val_metric], (int, float)):
                self.val.append((float(d["step"]), float(d[self.val_metric])))

    def observe(self, beats: dict[int, files.Heartbeat], now: float) -> None:
        """Heartbeats of this tick: rank 0's progress over time, every rank's recent busy times."""
        if 0 in beats:
            self.beats.append((beats[0].time, float(beats[0].step)))
        for r, b in beats.items():
            times = self.ranks.setdefault(r, {})
            for step, busy in b.recent:
                times[int(step)] = float(busy)
            if len(times) > RANK_HISTORY:
                for s in sorted(times)[: len(times) - RANK_HISTORY]:
                    del times[s]

    def rewind(self, to_step: int, next_attempt: int) -> None:
        """A roll-back to ``to_step``: forget the steps after it and the lines of earlier attempts."""
        self._read()
        self.min_attempt = next_attempt
        for series in (self.loss, self.grad, self.step_time, self.data_wait):
            kept = [p for p in series if p[0] <= to_step]
            series.clear()
            series.extend(kept)
        self.val = [p for p in self.val if p[0] <= to_step]
        self.loss_head = [p for p in self.loss_head if p[0] <= to_step]
        for times in self.ranks.values():
            for s in [s for s in times if s > to_step]:
                del times[s]
        self.seen = {(r, at) for r, at in self.seen if r not in EVENT_RULES or at <= to_step}
        self.active -= {Rule.LOSS_SPIKE, Rule.NONFINITE_LOSS, Rule.GRAD_NORM_EXPLOSION, Rule.STAGNATION}

    # ---------------------------------------------------------------- verdict
    def spent_usd(self, held_s: float) -> float:
        return self.spent_before + held_s * self.usd_per_s

    def poll(self, now: float, held_s: float, restart_times: Iterable[float] = (), force: bool = False) -> list[Firing]:
        """The alerts that are new at ``now`` (at most every ``alerts.every_s``, or at once with ``force``;
        [] in between). ``held_s``: seconds this stage has held its slots (training, restarts and backoff)."""
        if not self.spec.enabled or (now < self.next_eval and not force):
            return []
        self.next_eval = now + self.spec.every_s
        self._read()
        self.spend.append((now, self.spent_usd(held_s)))
        head_end = self.step_time_head[-1][0] if self.step_time_head else -math.inf
        step_time = self.step_time_head + [p for p in self.step_time if p[0] > head_end]
        loss_head_end = self.loss_head[-1][0] if self.loss_head else -math.inf
        loss = self.loss_head + [p for p in self.loss if p[0] > loss_head_end]
        ranks = {r: sorted(t.items()) for r, t in self.ranks.items()} if len(self.ranks) > 1 else {}
        # A storm counts the restarts after the last one raised: the next needs `count` more.
        last_storm = max((at for r, at in self.seen if r == Rule.RESTART_STORM), default=-math.inf)
        restart_times = [t for t in restart_times if t > last_storm]
        signals = Signals(
            loss=loss,
            val=self.val,
            grad_norm=list(self.grad),
            step_time=step_time,
            data_wait=list(self.data_wait),
            rank_step_times=ranks,
            gpu_util=list(self.gpu_util),
            restart_times=sorted(restart_times),
            spend_usd=list(self.spend),
            budget_usd=self.budget_usd,
            budget_scope=self.scope,
            heartbeats=list(self.beats),
        )
        firings = evaluate(signals, self.spec, now)
        new = []
        holding = set()
        for f in firings:
            if f.rule in EVENT_RULES:
                if (f.rule, f.at) not in self.seen:
                    self.seen.add((f.rule, f.at))
                    new.append(f)
            else:
                holding.add(f.rule)
                if f.rule not in self.active:
                    new.append(f)
        self.active = (self.active & EVENT_RULES) | holding
        return new


def alert_payload(f: Firing, stage: str, attempt: int) -> dict[str, Any]:
    """A firing as an event payload / logbook data: plain JSON."""
    return {
        "rule": str(f.rule),
        "severity": str(f.severity),
        "action": str(f.action),
        "at": f.at,
        "message": f.message,
        "stage": stage,
        "attempt": attempt,
        "values": {k: v for k, v in f.values.items() if isinstance(v, (int, float)) and math.isfinite(v)},
    }
