"""The training process: ``python -m traingate.runtime.train`` (under torchrun or alone).

init -> parse -> build -> train -> close. The orchestrator hands over everything about
this attempt as one StageJob (``--job``, or ``TRAINGATE_JOB``; see :mod:`traingate.job`);
this process reads nothing else of it and never calls back into Prefect. Rank 0 writes
``result.json`` into the stage directory; every rank writes a heartbeat each step and, on a
caught error, last words the supervisor reads (:mod:`traingate.job.files`). If the
supervisor dies, the ranks checkpoint and exit (:mod:`traingate.runtime.watchdog`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import psutil
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from traingate.job import envvars, files
from traingate.job.stagejob import StageJob
from traingate.job.vocab import INPLACE_OK, Cause, Status
from traingate.recipes import get_recipe
from traingate.recipes.base import TensorData
from traingate.redact import RedactingFilter
from traingate.runtime import exitcodes, inject, rng
from traingate.runtime.checkpoint import Checkpointer, CheckpointError, CheckpointRefused, RetentionPolicy
from traingate.runtime.dist import DistInfo, close_distributed, init_distributed
from traingate.runtime.failures import cause_of_exception, exit_code_for
from traingate.runtime.profile import StepProfile
from traingate.runtime.sampler import ResumableSampler
from traingate.runtime.spike_guard import SpikeGuard
from traingate.runtime.stagestats import StageStats
from traingate.runtime.watchdog import StopFlag
from traingate.settings import Settings, checkpoint_key
from traingate.spec import RunSpec, SpecError
from traingate.tracking.system import SystemSignals
from traingate.tracking.tracker import make_tracker, run_to_resume

CHECKPOINT_FALLBACK = "checkpoint-fallback"  # the alert a resume from an older checkpoint than the newest raises
log = logging.getLogger("traingate.runtime")
# Recipe data loaded by the zygote this process was forked from (traingate.runtime.warm), by spec hash.
_preloaded: dict[str, tuple[TensorData, TensorData]] = {}


@dataclass
class Outcome:
    status: Status = Status.COMPLETED  # completed | stopped | preempted | diverged
    steps_done: int = 0
    resumed_from_step: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    exit_code: int = exitcodes.OK


def _lr_lambda(spec: RunSpec, total_steps: int, scale: Callable[[], float] = lambda: 1.0):
    """The schedule; ``scale()`` is the roll-backs' factor (read at every step: it is set on resume)."""
    warm, sched = spec.optim.warmup_steps, spec.optim.schedule

    def f(step: int) -> float:
        if warm and step < warm:
            return scale() * (step + 1) / warm
        if sched == "constant":
            return scale()
        progress = min(1.0, (step - warm) / max(1, total_steps - warm))
        return scale() * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    return f


class Trainer:
    def __init__(
        self,
        job: StageJob,
        d: DistInfo,
        instruments: envvars.Instruments | None = None,
        timeline: dict[str, float] | None = None,
        stop: StopFlag | None = None,
    ):
        spec = job.spec
        self.timeline = dict(timeline or {})
        self.job, self.spec, self.stage, self.d = job, spec, job.stage, d
        self.out_dir = Path(job.stage_dir)
        self.max_steps = job.max_steps
        self.limits = getattr(spec.stages, job.stage)
        self.stop_at_step = job.stop_at_step
        instruments = instruments or envvars.Instruments()
        self.recipe = get_recipe(spec)
        train, self.val = _preloaded.get(spec.spec_hash()) or self.recipe.load_data()
        if self.limits.max_samples:
            train = train.head(self.limits.max_samples)
        self.train = train
        # Same init on every rank (DDP also broadcasts it); per-rank streams after that.
        rng.seed_all(spec.optim.seed)
        model = self.recipe.build_model().to(d.device)
        rng.seed_all(spec.optim.seed + 1 + d.rank)
        self.module = model
        if d.world_size > 1:
            self.model: torch.nn.Module = DDP(model, device_ids=[d.device] if d.device.type == "cuda" else None)
        else:
            self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=spec.optim.lr, weight_decay=spec.optim.weight_decay)
        self.lr_scale = 1.0  # the roll-backs' learning-rate factor, set on resume
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, _lr_lambda(spec, self.max_steps, lambda: self.lr_scale)
        )
        self.scaler = torch.amp.GradScaler("cuda", enabled=d.device.type == "cuda")
        self.micro = spec.optim.batch_size
        self.accum = spec.optim.grad_accum
        self.sampler = ResumableSampler(len(self.train), self.micro * self.accum * d.world_size, spec.optim.seed)
        self.step = 0
        self.stats = StageStats()  # the stage's, across its processes: restored on resume
        self._recent_losses: list[float] = []  # since the last save: the checkpoint's train_loss (keep_best)
        self.injector = inject.Injector.from_plan(instruments.inject, d.rank, self.out_dir)  # drills and tests only
        self._start_step = 0
        self._first_step_time: float | None = None
        self._last_dt: float | None = None
        self._busy: deque[list[float]] = deque(maxlen=16)  # [step, busy s]: the straggler rule's input
        self._iter_start = time.perf_counter()
        # Rank 0's per-step record for the supervisor's alert rules (and `traingate watch`).
        self.metrics_out = files.MetricsWriter(self.out_dir) if d.is_main and job.spec.alerts.enabled else None
        ck = spec.checkpoint
        storage_fault = self.injector.storage_hook if self.injector.faults else None
        self.ckpt = (
            Checkpointer(
                job.checkpoint_uri,
                RetentionPolicy(ck.keep_last, ck.keep_every, ck.keep_best, ck.best_metric, ck.best_mode),
                async_save=ck.async_save,
                in_flight=ck.in_flight,
                staging_dir=str(self.out_dir),
                fault_hook=inject.chain(instruments.fault_hook(), storage_fault),
                run_id=job.run_id,
                stage=self.stage,
                spec=spec,
                key=checkpoint_key(Settings.from_env()),
                on_fallback=self._record_fallback,
            )
            if d.is_main
            else None
        )
        self.mlflow_run_id = run_to_resume(job.mlflow_run_id, self.ckpt)  # checkpoints carry it forward
        self.tracker = make_tracker(
            d.rank,
            spec.tracking.enabled,
            job.tracking_uri,
            self.mlflow_run_id,
            journal_dir=self.out_dir / "tracking",
            deliver=job.tracking_delivery == "process",
        )
        self.signals = SystemSignals(d.rank, d.world_size, spec.tracking.enabled, d.device)
        self.profile = StepProfile()
        self.stop = stop if stop is not None else StopFlag(envvars.supervisor_pid())
        # Rank 0 tests each step's loss for a spike as it happens (traingate.runtime.spike_guard).
        self.spike_guard = (
            SpikeGuard(
                job.spec.alerts,
                lambda step: self.ckpt.pin_latest_before(step) if self.ckpt is not None else None,
                self._hold_for_supervisor,
                lambda: self.stop.requested,
            )
            if self.metrics_out is not None
            else None
        )
        # Line-buffered: a SIGKILL loses at most the line of the step in progress.
        self.sample_log = (
            open(self.out_dir / f"samples.rank{d.rank}.txt", "a", buffering=1) if instruments.record_samples else None
        )
        # Intermediate validation for sweeps: every `eval_every` steps rank 0 appends
        # {step, val_loss, val_accuracy, ...} to progress.jsonl; an in-process caller may also
        # pass `on_progress`, which stops training (status "stopped") by returning True.
        self.eval_every = job.eval_every
        self.on_progress: Callable[[dict[str, Any]], bool] | None = None

    def _record_fallback(self, uri: str, reason: str) -> None:
        """A newer checkpoint passed over for an older one: an alert in the stage and a restart entry in the
        run's logbook, each naming the checkpoint and why (a resume is never silently older than it could be)."""
        text = f"checkpoint {uri} passed over: {reason}; resuming from an older checkpoint"
        now = time.time()
        files.append_alert(
            self.out_dir,
            files.AlertRecord(
                time=now,
                stage=self.stage,
                rule=CHECKPOINT_FALLBACK,
                severity="warning",
                action="notify",
                at=now,
                message=text,
                attempt=self.job.attempt,
                outcome="resumed from an older checkpoint",
            ),
        )
        files.append_logbook(
            Path(self.job.run_dir),
            files.LogbookEntry(
                time=now, stage=self.stage, kind="restart", text=text, data={"file": uri, "reason": reason}
            ),
        )

    # ---------------------------------------------------------------- state
    def state(self) -> dict[str, Any]:
        rng_states = [rng.capture()]
        if self.d.world_size > 1:
            gathered: list[Any] = [None] * self.d.world_size
            dist.all_gather_object(gathered, rng_states[0])
            rng_states = gathered
        return {
            "model": self.module.state_dict(),
            "train_state": {
                "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(),
                "scaler": self.scaler.state_dict(),
                "sampler": self.sampler.state_dict(),
                "rng": rng_states,
                "step": self.step,
                "world_size": self.d.world_size,
                "stage_stats": self.stats.state_dict(),
            },
        }

    def save(self, emergency: bool = False) -> None:
        state = self.state()  # collective: every rank takes part
        recent, self._recent_losses = self._recent_losses, []
        if self.ckpt is not None:
            meta = {
                "run_id": self.job.run_id,
                "stage": self.stage,
                "spec_hash": self.spec.spec_hash(),
                "mlflow_run_id": self.mlflow_run_id,
                "emergency": emergency,
                "metrics": {"train_loss": sum(recent) / len(recent)} if recent else {},
            }
            # An emergency or final checkpoint is never skipped by the in-flight policy.
            self.ckpt.save(self.step, state, meta, force=emergency or self.step >= self.max_steps)
            if emergency:
                self.ckpt.wait()

    def resume(self) -> int:
        """Load the latest valid checkpoint of this run and stage, if any; return its step."""
        found = self.ckpt.load_latest() if self.ckpt is not None else None  # each file read and hashed once
        step = found[0] if found is not None else None
        if self.d.world_size > 1:
            box = [step]
            dist.broadcast_object_list(box, src=0)
            step = box[0]
        if step is None:
            return 0
        payload = [found[1] if found is not None else None]
        if self.d.world_size > 1:
            dist.broadcast_object_list(payload, src=0)
        state = payload[0]
        assert state is not None, "rank 0 found the checkpoint it broadcast"
        self.module.load_state_dict(state["model"])
        ts = state["train_state"]
        self.opt.load_state_dict(ts["optimizer"])
        self.sched.load_state_dict(ts["scheduler"])
        self.scaler.load_state_dict(ts["scaler"])
        self.sampler.load_state_dict(ts["sampler"])
        states = ts["rng"]
        # Same world size: each rank gets its own streams back. Otherwise rank r takes r mod saved.
        rng.restore(states[self.d.rank % len(states)])
        self.step = int(ts["step"])
        self.stats = StageStats.from_state(ts.get("stage_stats"))
        return self.step

    def _apply_rollbacks(self) -> None:
        """A roll-back's mitigation, when this launch resumes where one went back to: skip the offending
        batches (every rank draws the same ones) and scale the learning rate from here on."""
        if not self.job.rollbacks:
            return
        skip = self.job.batches_to_skip(self.step)
        for _ in range(skip):
            self.sampler.next_batch()
        self.lr_scale = self.job.lr_scale_at(self.step)
        for group, base in zip(self.opt.param_groups, self.sched.base_lrs):
            group["lr"] = base * self.sched.lr_lambdas[0](self.sched.last_epoch)
        if self.d.is_main:
            log.warning(
                "roll-back mitigation at step %d: skipped %d batches, learning rate x%g", self.step, skip, self.lr_scale
            )

    # ---------------------------------------------------------------- loop
    def _train_step(self) -> tuple[float, float, bool, bool]:
        t_data = time.perf_counter()
        ids = ResumableSampler.shard(self.sampler.next_batch(), self.d.rank, self.d.world_size)
        micro_ids = [ids[i * self.micro : (i + 1) * self.micro] for i in range(self.accum)]
        batches = [tuple(t.to(self.d.device, non_blocking=True) for t in self.train.batch(m)) for m in micro_ids]
        self.profile.data_wait(time.perf_counter() - t_data)
        if self.sample_log is not None:
            self.sample_log.write(f"{self.step + 1} {' '.join(map(str, ids))}\n")
        total = torch.zeros((), device=self.d.device)
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            ctx = cast(DDP, self.model).no_sync() if (self.d.world_size > 1 and not last) else contextlib.nullcontext()
            with ctx:
                loss = self.recipe.loss(self.model, batch) / self.accum
                if last:  # the backward of the last micro-batch waits for every rank's gradients
                    self._busy.append([self.step + 1, time.perf_counter() - self._iter_start])
                self.scaler.scale(loss).backward()
            total += loss.detach()
        self.scaler.unscale_(self.opt)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.spec.optim.max_grad_norm)
        # One small all-reduce a step: the global loss, whether any rank saw a non-finite value,
        # and whether any rank was asked to stop -- so every rank takes the same decision.
        flags = torch.stack(
            [total, (~torch.isfinite(total)).float(), torch.tensor(float(self.stop.requested), device=self.d.device)]
        )
        if self.d.world_size > 1:
            sums = flags.clone()
            dist.all_reduce(sums[:2], op=dist.ReduceOp.SUM)
            stopv = flags[2:].clone()
            dist.all_reduce(stopv, op=dist.ReduceOp.MAX)
            flags = torch.cat([sums[:1] / self.d.world_size, sums[1:2], stopv])
        loss_v, nonfinite, stop = float(flags[0]), bool(flags[1] > 0), bool(flags[2] > 0)
        if nonfinite or not math.isfinite(float(grad_norm)):
            self.opt.zero_grad(set_to_none=True)  # skip the update; the step still counts
            self.scaler.update()
            nonfinite = True
        else:
            self.scaler.step(self.opt)
            self.scaler.update()
            self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        self.step += 1
        return loss_v, float(grad_norm), nonfinite, stop

    def _progress(self) -> bool:
        """Validate now, append to progress.jsonl, and ask ``on_progress`` whether to stop."""
        if not self.d.is_main:
            return False
        self.model.eval()
        evals = self.recipe.evaluate(self.module, self.val, max(64, self.micro))
        self.model.train()
        rec = {
            "step": self.step,
            "time": time.time(),
            **{k: float(v) for k, v in evals.items() if isinstance(v, (int, float))},
        }
        files.append_progress(self.out_dir, rec)
        self.tracker.log_metrics({k: v for k, v in rec.items() if k.startswith("val_")}, step=self.step)
        return bool(self.on_progress and self.on_progress(rec))

    def _hold_for_supervisor(self) -> None:
        """Everything the supervisor judges by is on disk before rank 0 waits for its decision."""
        assert self.metrics_out is not None
        self.metrics_out.f.flush()
        self._heartbeat("holding")

    def _heartbeat(self, phase: str = "train") -> None:
        """``phase``: train | holding | preempting | finishing; outside "train" the supervisor allows slow progress."""
        now = time.time()
        if self._first_step_time is None and self.step > self._start_step:
            self._first_step_time = now  # the supervisor's time-to-recovery ends here
        files.write_heartbeat(
            self.out_dir,
            files.Heartbeat(
                rank=self.d.rank,
                step=self.step,
                time=now,
                pid=os.getpid(),
                start_step=self._start_step,
                first_step_time=self._first_step_time,
                phase=phase,
                restart_count=envvars.inplace_restart_count(),
                timeline=self.timeline,
                step_time_s=self._last_dt,
                data_wait_s=self.profile.last_data_wait,
                recent=list(self._busy),
            ),
        )

    def run(self) -> Outcome:
        out = Outcome()
        out.resumed_from_step = self.resume()
        if self.spike_guard is not None and out.resumed_from_step:
            self.spike_guard.seed(files.read_metrics(self.out_dir), out.resumed_from_step)
        self._apply_rollbacks()
        self.timeline["loaded"] = time.time()
        self.tracker.start_session(out.resumed_from_step, self._restart_cause())
        # A group torchrun restarted in place starts with this process, not with the job's launch.
        self.profile.started(self.job.launched_at if not envvars.inplace_restart_count() else None)
        if self.d.is_main:
            log.info(
                "stage %s: world %d on %s (backend %s), steps %d -> %d, %d train samples%s",
                self.stage,
                self.d.world_size,
                self.d.device,
                self.d.backend or "none",
                self.step,
                self.max_steps,
                len(self.train),
                f", resumed from step {out.resumed_from_step}" if out.resumed_from_step else "",
            )
        every_steps, every_s = self.job.checkpoint_every_steps, self.job.checkpoint_every_s
        last_ckpt_time = time.monotonic()
        self.model.train()
        tolerance = self.spec.optim.nonfinite_tolerance
        tps = self.recipe.tokens_per_sample()
        global_batch = self.sampler.global_batch
        self._start_step = self.step
        self._heartbeat()
        if self.ckpt is not None:  # host buffers for the weights and AdamW's two moments, off the first save
            self.ckpt.prepare(self.module.state_dict(), copies=3)
        while self.step < self.max_steps:
            # This rank's busy time runs from here (the end of the previous step's collectives) to its
            # last backward: whatever it does between steps, it makes its peers wait for.
            self._iter_start = time.perf_counter()
            self.injector.before_step(self.step, self.module)
            t0 = time.perf_counter()
            loss, gnorm, bad, stop = self._train_step()
            dt = time.perf_counter() - t0
            self.profile.step(dt)
            self._last_dt = dt
            self._heartbeat()
            self.stats.observe(loss, gnorm, finite=not bad)
            if not bad:
                self._recent_losses.append(loss)
            system: dict[str, float] = {}
            if self.step % self.spec.tracking.log_every == 0 or self.step == self.max_steps:
                system = self.signals.collect(dt)
                self.tracker.log_metrics(
                    {
                        "train_loss": loss,
                        "lr": float(self.sched.get_last_lr()[0]),
                        "grad_norm": gnorm,
                        "step_time_s": dt,
                        "samples_per_s": global_batch / dt,
                        "tokens_per_s": global_batch * tps / dt,
                        "data_wait_s": self.profile.last_data_wait,
                        **system,
                    },
                    step=self.step,
                )
            if self.metrics_out is not None:
                self.metrics_out.write(
                    files.StepMetrics(
                        self.step,
                        time.time(),
                        loss,
                        gnorm,
                        float(self.sched.get_last_lr()[0]),
                        dt,
                        self.profile.last_data_wait,
                        self.job.attempt,
                        gpu_util_percent=system.get(
                            "system/gpu_util_percent_mean", system.get("system/rank0/gpu_util_percent")
                        ),
                    )
                )
            if self.spike_guard is not None and not bad:
                self.spike_guard.observe(self.step, loss)
            if self.eval_every and self.step % self.eval_every == 0 and self._progress():
                out.status = Status.STOPPED
                break
            if self.stats.nonfinite > tolerance:
                out.status, out.exit_code = Status.DIVERGED, exitcodes.DIVERGED
                log.error(
                    "non-finite loss at step %d (%d steps > tolerance %d); stopping",
                    self.step,
                    self.stats.nonfinite,
                    tolerance,
                )
                break
            if stop:
                log.warning("%s: writing emergency checkpoint at step %d", self.stop.reason, self.step)
                self._heartbeat("preempting")
                # Honoured once. torchrun forwards a SIGTERM to ranks still exiting when the first one
                # is done; during interpreter shutdown Python's handler is gone and it would kill the
                # rank (exit -15) instead of letting it report "preempted".
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                self.save(emergency=True)
                out.status, out.exit_code = Status.PREEMPTED, exitcodes.PREEMPTED
                break
            if self.stop_at_step is not None and self.step >= self.stop_at_step:
                self.save(emergency=True)
                out.status = Status.STOPPED
                break
            due_steps = every_steps and self.step % every_steps == 0
            due_time = every_s and time.monotonic() - last_ckpt_time >= every_s
            if self.d.world_size > 1 and every_s:
                box = torch.tensor(float(bool(due_time)))
                dist.all_reduce(box, op=dist.ReduceOp.MAX)  # wall clocks differ; agree on one step
                due_time = bool(box > 0)
            if (due_steps or due_time) and self.step < self.max_steps:
                self.save()
                last_ckpt_time = time.monotonic()
        out.steps_done = self.step
        if self.metrics_out is not None:
            self.metrics_out.f.flush()  # the supervisor judges the last steps too
        self._heartbeat("finishing")  # final save, evaluation, exit: slow is not hung
        if out.status == Status.COMPLETED:
            self.save()  # the final state is a checkpoint too (the stage's artifact)
        if self.ckpt is not None:
            self.ckpt.wait()
        out.metrics = self._summary(out)
        self.tracker.end_session(out.status)
        return out

    def _summary(self, out: Outcome) -> dict[str, Any]:
        # The loss curve, its non-finite steps and gradient peak are the stage's since its step 0, not this
        # process's: a resumed stage's gate judges the stage (traingate.runtime.stagestats).
        m: dict[str, Any] = {
            **self.stats.summary(),
            "steps": self.step,
            "resumed_from_step": out.resumed_from_step,
            "world_size": self.d.world_size,
        }
        if out.status == Status.COMPLETED:
            self.model.eval()
            evals = self.recipe.evaluate(self.module, self.val, max(64, self.micro))
            self.model.train()
            for name, value in evals.items():
                if isinstance(value, (int, float)):
                    m[name] = float(value)
            m["eval"] = {k: v for k, v in evals.items() if not isinstance(v, (int, float))}
        prof = self.profile.summary(self.sampler.global_batch, self.recipe.tokens_per_sample())
        m["profile"] = prof
        final = {k: v for k, v in m.items() if isinstance(v, (int, float))}
        final.update({f"profile_{k}": v for k, v in prof.items() if isinstance(v, (int, float))})
        self.tracker.log_metrics({k: v for k, v in final.items() if k != "steps"}, step=self.step)
        return m

    def _restart_cause(self) -> str | None:
        """Why this process is a restart: the supervisor's verdict, or a lost worker when torchrun
        restarted the group in place (it does that only when a worker failed)."""
        if envvars.inplace_restart_count():
            return Cause.WORKER_LOST
        return self.job.restart_cause

    def close(self) -> None:
        try:
            if self.ckpt is not None:
                self.ckpt.close()
            self.tracker.close()
        finally:
            if self.sample_log is not None:
                self.sample_log.close()
            if self.metrics_out is not None:
                self.metrics_out.close()


def _rank_tagger(rank: str) -> Callable[[logging.LogRecord], bool]:
    """A log filter that tags every record with this process's rank (the log format shows it)."""

    def tag(record: logging.LogRecord) -> bool:
        record.__dict__["rank"] = rank
        return True

    return tag


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m traingate.runtime.train")
    p.add_argument("--job", default=None, help=f"the attempt's job.json (default: ${envvars.JOB})")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [rank %(rank)s] %(message)s")
    rank = os.environ.get("RANK", "0")
    for h in logging.getLogger().handlers:
        h.addFilter(_rank_tagger(rank))
        h.addFilter(RedactingFilter())
    # The optimizer's first step imports TorchDynamo (~1.3 s, torch's own doing). Started now, that import
    # overlaps the job read, the rendezvous and the checkpoint read (which wait on I/O) instead of
    # delaying the first step of every start and every restart.
    threading.Thread(target=importlib.import_module, args=("torch._dynamo",), name="warm-imports", daemon=True).start()
    args = _parse(argv)
    path = Path(args.job) if args.job else envvars.job_path()
    if path is None:
        print(f"python -m traingate.runtime.train: no job; pass --job PATH or set {envvars.JOB}", file=sys.stderr)
        return exitcodes.USER_ERROR
    out_dir = path.parent
    trainer: Trainer | None = None
    d: DistInfo | None = None
    timeline = {"process_start": process_start_time(), "imported": time.time()}
    try:
        job = StageJob.read(path)
        out_dir = Path(job.stage_dir)
        if (orphan := StopFlag.orphaned_now(envvars.supervisor_pid())) is not None:
            _stop_agent()  # an in-place restart after the supervisor died: do not even join the group
            return _last_words(out_dir, None, Cause.ORCHESTRATOR_LOST, RuntimeError(orphan), exitcodes.PREEMPTED)
        # Taken from here on, not only once the trainer is built: a SIGTERM (a pause, a preemption) that
        # comes during the rendezvous or the build (seconds on a busy machine) stops the rank at its
        # first step with an emergency checkpoint, instead of killing it with no checkpoint.
        stop = StopFlag(envvars.supervisor_pid())
        d = init_distributed()
        timeline["rendezvous"] = time.time()
        out_dir.mkdir(parents=True, exist_ok=True)
        trainer = Trainer(job, d, envvars.Instruments.from_environ(), timeline, stop)
        outcome = trainer.run()
        if d.is_main:
            files.write_result(
                out_dir,
                files.RuntimeResult(
                    status=outcome.status,
                    exit_code=outcome.exit_code,
                    steps_done=outcome.steps_done,
                    resumed_from_step=outcome.resumed_from_step,
                    metrics=outcome.metrics,
                    checkpoint_uri=trainer.ckpt.uri if trainer.ckpt else None,
                    last_checkpoint_step=trainer.ckpt.last_saved_step if trainer.ckpt else None,
                    checkpoint_blocked_s=trainer.ckpt.blocked_s if trainer.ckpt else 0.0,
                ),
            )
        trainer.close()
        if outcome.status == Status.DIVERGED:
            _no_restart_in_place(out_dir, outcome.exit_code, Cause.DIVERGED)
        orphan = trainer.stop.reason if trainer.stop.orphaned else None
        if outcome.status == Status.PREEMPTED and orphan is None:
            # A SIGTERM that came before this rank's watch saw its supervisor die (the CLI's guardian stops
            # the tree of a killed CLI) is that loss, not a preemption.
            orphan = StopFlag.orphaned_now(envvars.supervisor_pid())
        if outcome.status == Status.PREEMPTED and orphan is not None:
            _stop_agent()  # torchrun would restart the group in place: nobody is left to want that
            return _last_words(out_dir, d, Cause.ORCHESTRATOR_LOST, RuntimeError(orphan), exitcodes.PREEMPTED)
        if outcome.status == Status.PREEMPTED and "TORCHELASTIC_RUN_ID" in os.environ:
            # torchrun's agent may restart a preempted group in place (traingate.runtime.agent): these words
            # tell the supervisor why this incarnation ended, its checkpoint written.
            _last_words(
                out_dir,
                d,
                Cause.PREEMPTED,
                RuntimeError(f"{trainer.stop.reason}: emergency checkpoint written at step {outcome.steps_done}"),
                exitcodes.PREEMPTED,
            )
        return outcome.exit_code
    except (SpecError, CheckpointRefused) as e:
        return _no_restart_in_place(
            out_dir, _last_words(out_dir, d, Cause.USER_ERROR, e, exitcodes.USER_ERROR), Cause.USER_ERROR
        )
    except CheckpointError as e:
        cause = cause_of_exception(e)
        cause = cause if cause == Cause.DISK_FULL else Cause.CHECKPOINT_ERROR
        return _no_restart_in_place(out_dir, _last_words(out_dir, d, cause, e, exit_code_for(cause)), cause)
    except Exception as e:  # noqa: BLE001 - classified and reported through last words, then exit non-zero
        cause = cause_of_exception(e)
        return _no_restart_in_place(out_dir, _last_words(out_dir, d, cause, e, exit_code_for(cause)), cause)
    finally:
        if trainer is not None and trainer.ckpt is not None:
            trainer.ckpt.close(raise_errors=False)  # flush an in-flight save on every way out
        close_distributed()


def preload_data(job_path: str | Path) -> str:
    """Load the recipe data of the job at ``job_path`` into this process, for the workers it forks; its spec hash.

    A zygote calls it once its first workers are forked: every worker it forks afterwards (an in-place restart's)
    finds the data in memory instead of loading it again (digits-cnn: 30-50 ms of CPU per rank). Keyed by the
    spec's hash, so a job whose spec differs loads its own. Loading is deterministic (a fixed split; the trainer
    seeds the RNGs after it), so a preloaded worker trains bit for bit as one that loaded the data itself.
    """
    spec = StageJob.read(job_path).spec
    key = spec.spec_hash()
    if key not in _preloaded:
        _preloaded.clear()  # a run's zygote serves its stages in turn: it holds the data of one spec at a time
        _preloaded[key] = get_recipe(spec).load_data()
    return key


def process_start_time() -> float:
    """When this process started (epoch seconds, to the kernel's 10 ms tick).

    psutil's ``create_time`` adds the start tick to the boot time, which the kernel reports in whole
    seconds: up to a second early, which would charge a restart's launch to its imports. The process's
    age on the uptime clock, taken from now, has no such error.
    """
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return psutil.Process().create_time()


def _stop_agent() -> None:
    """SIGTERM torchrun's agent (this rank's parent), so it stops the group instead of restarting it."""
    if envvars.inplace_restart_count() or "TORCHELASTIC_RUN_ID" in os.environ:
        with contextlib.suppress(ProcessLookupError):
            os.kill(os.getppid(), signal.SIGTERM)


def _no_restart_in_place(out_dir: Path, code: int, cause: Cause) -> int:
    """Stop the group for a failure a restart in place cannot fix (``cause`` not in ``INPLACE_OK``); ``code``.

    torchrun answers a failed worker by restarting the group in place. The supervisor stops the tree when it
    reads this rank's last words, but a zygote forks the next incarnation in milliseconds, which would begin
    (and count as an attempt) before that stop arrives. So the first failing rank marks the launch stopped and
    SIGTERMs its agent, which then shuts the group down (traingate.runtime.agent) as on the supervisor's stop.
    """
    if cause not in INPLACE_OK and (envvars.inplace_restart_count() or "TORCHELASTIC_RUN_ID" in os.environ):
        try:
            claimed = files.claim_stop(out_dir, f"{cause}: a restart in place cannot fix it")
        except OSError as e:
            log.error("could not mark the launch stopped: %s", e)
            claimed = False
        if claimed:
            _stop_agent()
    return code


def _last_words(out_dir: Path, d: DistInfo | None, cause: Cause, e: BaseException, code: int) -> int:
    rank = d.rank if d else int(os.environ.get("RANK", "0"))
    log.error("%s: %s", cause, e)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        files.write_last_words(
            out_dir,
            files.LastWords(
                rank=rank,
                cause=cause,
                error=f"{type(e).__name__}: {e}",
                time=time.time(),
                exit_code=code,
                traceback=traceback.format_exc()[-4000:],
                restart_count=envvars.inplace_restart_count(),
            ),
        )
    except OSError as write_err:
        log.error("could not write last words: %s", write_err)
    return code


if __name__ == "__main__":
    code = main()
    # What the process owes is written and closed by now (result, last words, checkpoint, tracker, process
    # group). The interpreter's teardown with torch loaded costs seconds of CPU on a busy node (2 s at load 9
    # here), which a preempted rank would spend inside the scheduler's kill window: exit as a warm worker does.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
