"""The alert rules' actions while a stage runs: notify, pause, stop, roll back, quarantine.

The monitor (:mod:`traingate.monitor.live`) decides what fires; this carries it out on the running
tree and records every firing (alerts.jsonl, the run's logbook, the caller's hook, the webhook).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from traingate.alerts.rules import Action, Firing, Severity, stale_checkpoint
from traingate.capacity import slurm_cli
from traingate.capacity.slurm import SlurmError
from traingate.job import files
from traingate.job.catalog import CheckpointCatalog
from traingate.job.stagejob import Rollback, StageJob
from traingate.job.vocab import Cause
from traingate.launch import proc
from traingate.monitor import notify
from traingate.monitor.live import StageMonitor, alert_payload
from traingate.supervision import heartbeat
from traingate.supervision.attempts import Attempt, Hooks
from traingate.supervision.checkpoints import latest_checkpoint


class AlertActions:
    """What the alerts did to one launch. ``stopping(reason)`` is told when an alert pauses or stops it."""

    def __init__(
        self,
        job: StageJob,
        hooks: Hooks,
        monitor: StageMonitor | None,
        started: float,
        stopping: Callable[[str], None],
    ):
        self.job, self.hooks, self.monitor, self.started, self.stopping = job, hooks, monitor, started, stopping
        self.stage_dir = Path(job.stage_dir)
        self.rollback: Rollback | None = None  # an alert ordered a roll-back: the tree is being killed
        self.alert_stop: Firing | None = None  # an alert paused or stopped the stage
        self.unsaved_pause: str | None = None  # why a pause writes no emergency checkpoint (nothing good to keep)
        self.alerted = False  # the checkpoint-staleness alert fired in the current stale spell

    def observe(
        self, beats: dict[int, files.Heartbeat], now: float, attempts: list[Attempt], tree: proc.ProcessTree
    ) -> bool:
        """Feed this tick's heartbeats to the monitor and act on what fires; True: stop the tree (SIGTERM)."""
        if self.monitor is None or self.rollback is not None:
            return False
        self.monitor.observe(beats, now)
        restarts = [a.ended_at for a in attempts[:-1] if a.ended_at and a.cause != Cause.ROLLBACK]
        stop = False
        # Rank 0 holding at a spike it saw itself (runtime.spike_guard) waits for this decision: now.
        holding = 0 in beats and beats[0].phase == "holding"
        for firing in self.monitor.poll(now, now - self.started, restarts, force=holding):
            if self.rollback is not None or self.alert_stop is not None:
                # One action at a time: a spike usually trips the gradient-norm rule at the same step.
                self.record(
                    firing,
                    "no further action: the stage is already being "
                    f"{'rolled back' if self.rollback is not None else 'stopped'}",
                )
                continue
            stop = self.act(firing, tree) or stop
        return stop

    def check_staleness(self, beat: files.Heartbeat, now: float, tree: proc.ProcessTree, attempt: Attempt) -> bool:
        """alerts.checkpoint_stale: no new checkpoint within its `factor` x the checkpoint interval (steps or
        minutes), counted from the newest checkpoint or this launch. Fires once per stale spell and carries
        out its action like every alert; True: stop the tree (pause, stop)."""
        alerts = self.job.spec.alerts
        if not (alerts.enabled and alerts.checkpoint_stale.enabled):
            return False
        last_step, created = latest_checkpoint(self.job.checkpoint_uri)
        start = attempt.start_steps.get(0, beat.start_step)
        # From rank 0's first step at the earliest: start-up (imports, rendezvous, loading) writes no checkpoint.
        since = now - max(created or 0.0, attempt.launched_at, beat.first_step_time or now)
        why = heartbeat.checkpoint_stale(
            beat.step,
            max(last_step or 0, start or 0),
            self.job.checkpoint_every_steps,
            since,
            self.job.checkpoint_every_s,
            factor=alerts.checkpoint_stale.factor,
        )
        if why is None:
            self.alerted = False
            return False
        if self.alerted or self.rollback is not None or self.alert_stop is not None:
            return False
        self.alerted = True
        return self.act(stale_checkpoint(why, beat.step, alerts.checkpoint_stale), tree)

    def act(self, f: Firing, tree: proc.ProcessTree) -> bool:
        """Carry out an alert's action; True: stop the tree with SIGTERM (its emergency checkpoint)."""
        stage = self.job.stage
        action = f.action
        rb = self.job.spec.alerts.rollback
        if action == Action.ROLLBACK and len(self.job.rollbacks) >= rb.max_rollbacks:
            action = Action.PAUSE
            outcome = f"paused: alerts.rollback.max_rollbacks ({rb.max_rollbacks}) roll-backs already done"
        elif action == Action.ROLLBACK:
            steps = CheckpointCatalog(self.job.checkpoint_uri).list_steps()
            at = int(f.at)
            to = max((s for s in steps if s < at), default=None)
            if to is None:
                # Going back to step 0 would throw the run away; a checkpoint written now would hold the state
                # gone bad. Stop without one and say so: the person deciding has the numbers.
                action = Action.PAUSE
                self.unsaved_pause = f"no checkpoint before step {at} to roll back to"
                outcome = (
                    f"paused: {self.unsaved_pause} (none written: it would hold the state gone bad); "
                    f"`traingate resume {self.job.run_id}` starts the stage over"
                )
            else:
                self.rollback = Rollback(
                    to_step=to,
                    at_step=at,
                    skip=at - to if rb.skip_batches else 0,
                    lr_scale=rb.lr_scale,
                    rule=str(f.rule),
                )
                outcome = (
                    f"rolling back to step {to} (checkpoint), skipping {self.rollback.skip} batches, "
                    f"learning rate x{rb.lr_scale:g}"
                )
        elif (
            action == Action.QUARANTINE
            and (node := slurm_cli.node_of_rank(_whole(f.values.get("rank")), self.job.procs_per_node, os.environ))
            is not None
        ):
            # On a Slurm pool the engine keeps the host out of every later job: drain it.
            _quarantine(self.job, node, f)
            try:
                slurm_cli.set_node_state(node, "drain", f"traingate:{f.rule}")
                drained = f"Slurm node {node} drained (reason traingate:{f.rule})"
            except SlurmError as e:
                drained = f"Slurm node {node} NOT drained ({e})"
            action = Action.PAUSE
            outcome = (
                f"{drained}, quarantine.json; paused: resume with `traingate resume {self.job.run_id}`, "
                "Slurm places it on other nodes"
            )
        elif action == Action.QUARANTINE:
            # One host per stage here: leaving it out of the next launch leaves nothing to launch on.
            host = socket.gethostname()
            _quarantine(self.job, host, f)
            action = Action.PAUSE
            outcome = (
                f"host {host} quarantined (run directory quarantine.json); paused: no other host for this "
                f"stage; resume on a healthy host with `traingate resume {self.job.run_id}`"
            )
        else:
            outcome = {
                Action.NOTIFY: "notified",
                Action.PAUSE: f"paused at an emergency checkpoint; continue with `traingate resume {self.job.run_id}`",
                Action.STOP: "stopped for good",
            }[action]
        self.record(f, outcome)
        if action == Action.ROLLBACK:
            tree.stop_requested = True
            tree.signal_group(signal.SIGKILL)  # no emergency checkpoint: it would save the state gone bad
            return False
        if action in (Action.PAUSE, Action.STOP):
            self.alert_stop = dataclasses.replace(f, action=action)
            reason = f"{f.rule}: {f.message}"
            if self.unsaved_pause is not None:
                self.stopping(f"{reason}; {self.unsaved_pause}")
                self.hooks.info(f"{stage}: paused by alert {f.rule}: SIGKILL to the tree, no emergency checkpoint")
                tree.stop_requested = True
                tree.signal_group(signal.SIGKILL)
                return False
            self.stopping(reason)
            self.hooks.info(
                f"{stage}: {action} by alert {f.rule}: SIGTERM to the tree, "
                f"{self.job.spec.supervision.preempt_grace_s:.0f} s grace for the emergency checkpoint"
            )
            return True
        return False

    def record(self, f: Firing, outcome: str) -> None:
        """Every firing: a line in alerts.jsonl and in the run's logbook, the log, and the caller's hook
        (a Prefect event and an MLflow tag in the launch task)."""
        now = time.time()
        payload = {**alert_payload(f, self.job.stage, self.job.attempt), "outcome": outcome}
        files.append_alert(
            self.stage_dir,
            files.AlertRecord(
                time=now,
                stage=self.job.stage,
                rule=str(f.rule),
                severity=str(f.severity),
                action=str(f.action),
                at=f.at,
                message=f.message,
                attempt=self.job.attempt,
                outcome=outcome,
                values=payload["values"],
            ),
        )
        files.append_logbook(
            Path(self.job.run_dir),
            files.LogbookEntry(
                time=now, stage=self.job.stage, kind="alert", text=f"{f.message} -> {outcome}", data=payload
            ),
        )
        line = f"{self.job.stage}: ALERT {f.severity} {f.message} -> {outcome}"
        say = self.hooks.error if f.severity == Severity.CRITICAL and self.hooks.error is not None else self.hooks.info
        say(line)
        if self.hooks.on_alert is not None:
            self.hooks.on_alert(f"alert.{f.rule}", payload)
        if self.job.spec.alerts.webhook_url:
            notify.post(self.job.spec.alerts.webhook_url, {"run_id": self.job.run_id, **payload}, self.hooks.info)


def roll_back(job: StageJob, rb: Rollback, attempt: Attempt, hooks: Hooks, monitor: StageMonitor | None) -> StageJob:
    """After the tree was killed for a roll-back: set the checkpoints after the target aside (no restart may
    resume from the state gone bad; they are removed only once the rolled-back run passes their steps), log
    it, and return the next attempt's job carrying the mitigation."""
    attempt.cause, attempt.retryable = Cause.ROLLBACK, True
    attempt.detail = f"{rb.rule} at step {rb.at_step}: back to step {rb.to_step}"
    from traingate.runtime.checkpoint import Checkpointer  # lazy: torch, which a supervisor needs only here

    aside = Checkpointer(job.checkpoint_uri, async_save=False).set_aside_after(rb.to_step)
    text = (
        f"rolled back from step {attempt.end_step} to step {rb.to_step} after {rb.rule} at step {rb.at_step}: "
        f"skipping {rb.skip} batches, learning rate x{rb.lr_scale:g}, checkpoints set aside: {aside or 'none'}"
    )
    hooks.info(f"{job.stage}: {text}")
    files.append_logbook(
        Path(job.run_dir),
        files.LogbookEntry(
            time=time.time(),
            stage=job.stage,
            kind="rollback",
            text=text,
            data={**asdict(rb), "from_step": attempt.end_step, "set_aside_checkpoints": aside},
        ),
    )
    if hooks.on_alert is not None:
        hooks.on_alert("run.rolled_back", {"stage": job.stage, **asdict(rb), "from_step": attempt.end_step})
    nxt = job.next_attempt(Cause.ROLLBACK, attempt.ended_at)
    nxt = dataclasses.replace(nxt, rollbacks=(*job.rollbacks, rb))
    if monitor is not None:
        monitor.rewind(rb.to_step, nxt.attempt)
    return nxt


def _whole(value: float | None) -> int | None:
    """A firing's rank value (signals are floats) as the rank it is."""
    return None if value is None else int(value)


def _quarantine(job: StageJob, host: str, f: Firing) -> None:
    path = Path(job.run_dir) / "quarantine.json"
    entries = files.read_json(path) or []
    entries.append(
        {
            "host": host,
            "stage": job.stage,
            "rule": str(f.rule),
            "message": f.message,
            "time": time.time(),
            "rank": f.values.get("rank"),
        }
    )
    files.write_json(path, entries)
