"""Resume drills for the runtime tests: launch real training processes, interrupt them, compare.

A drill is one run (one stage directory, one checkpoint root) driven through several
process lifetimes: a real ``python -m traingate.runtime.train`` (or ``torchrun`` with N
workers) is launched, interrupted - SIGKILL from outside at a chosen step, a self-kill
in the middle of a checkpoint save (``TRAINGATE_FAULT``), or SIGTERM - and relaunched,
until it completes. Steps of these tiny models take milliseconds, so to stop a run at
a chosen step the drill paces it from outside: it alternately SIGSTOPs and SIGCONTs the
whole process tree for a couple of milliseconds, reading rank 0's heartbeat while the
tree is stopped, and kills it once the heartbeat reaches the target.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from tgtest import write_job
from traingate.runtime.checkpoint import Checkpointer

PYTHON = sys.executable
LAUNCH_TIMEOUT_S = 240.0

SPEC_HEAD = """
identity: {experiment: tests, owner: tester, team: platform, purpose: resume drills}
tracking: {enabled: false}
"""
RECIPES = {
    # Dropout on in both, so the RNG state is part of what must come back exactly.
    "digits": """
recipe: {name: digits-cnn, params: {channels: 4, hidden: 16, dropout: 0.1}}
optim: {lr: 0.01, batch_size: 16, seed: 3}
""",
    "chargpt": """
recipe: {name: char-gpt, params: {n_layer: 1, n_embd: 16, n_head: 2, block_size: 16, max_chars: 4000, dropout: 0.1}}
optim: {lr: 0.01, batch_size: 8, seed: 3, warmup_steps: 3}
""",
}


def write_spec(path: Path, recipe: str, max_steps: int, checkpoint: str) -> Path:
    path.write_text(SPEC_HEAD + RECIPES[recipe] + f"stages: {{full: {{max_steps: {max_steps}}}}}\n"
                    + textwrap.dedent(checkpoint))
    return path


@dataclass
class Interruption:
    """What one interrupted (or final) process lifetime did."""

    kind: str                      # reference | kill | fault:<phase> | sigterm | final
    returncode: int
    start_latest: int | None       # newest valid checkpoint before this launch
    target: int | None = None      # step the drill aimed at (kill, sigterm) or the fault's save step
    heartbeats: dict[int, int] = field(default_factory=dict)  # rank -> last step it reported
    latest: int | None = None      # newest valid checkpoint after this launch
    latest_loads: bool = False
    stderr: str = ""
    complete_steps: list[int] = field(default_factory=list)  # steps with a manifest after this launch
    latest_manifest: dict[str, Any] | None = None
    result: dict[str, Any] | None = None                    # result.json, if rank 0 wrote one
    seconds: float = 0.0                                     # launch to exit


class Drill:
    def __init__(self, name: str, spec: Path, nproc: int, root: Path, checkpoint_uri: str | None = None,
                 env: dict[str, str] | None = None):
        self.name, self.spec, self.nproc = name, spec, nproc
        self.out = root / name
        self.out.mkdir(parents=True, exist_ok=True)
        self.checkpoint_uri = checkpoint_uri or (self.out / "checkpoints").as_uri()
        self.base_env = dict(env if env is not None else os.environ)
        self.job_path = write_job(spec, self.out, run_id=name, checkpoint_uri=self.checkpoint_uri)
        self.history: list[Interruption] = []
        self._n = 0

    # ------------------------------------------------------------------ processes
    def _command(self, extra: list[str]) -> list[str]:
        tail = ["-m", "traingate.runtime.train", "--job", str(self.job_path), *extra]
        if self.nproc == 1:
            return [PYTHON, *tail]
        return [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.nproc}",
                f"--log-dir={self.job_path.parent / 'torchelastic'}", *tail]

    def _launch(self, env_extra: dict[str, str] | None = None, args: list[str] | None = None) -> subprocess.Popen:
        for hb in self.out.glob("heartbeat.rank*.json"):
            hb.unlink()  # a heartbeat must come from this launch
        (self.out / "result.json").unlink(missing_ok=True)
        env = dict(self.base_env)
        env.update({"TRAINGATE_STAGE_DIR": str(self.out), "TRAINGATE_CHECKPOINT_DIR": self.checkpoint_uri,
                    "TRAINGATE_RUN_ID": self.name, "TRAINGATE_RECORD_SAMPLES": "1", "OMP_NUM_THREADS": "1",
                    "PYTHONUNBUFFERED": "1", "TRAINGATE_LAUNCH_TS": repr(time.time())})
        for var in ("TRAINGATE_FAULT", "TRAINGATE_INJECT", "MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI"):
            env.pop(var, None)
        env.update(env_extra or {})
        self._n += 1
        self._t_launch = time.monotonic()
        self._stderr_path = self.out / f"launch{self._n}.stderr"
        return subprocess.Popen(self._command(args or []), env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=open(self._stderr_path, "wb"),
                                start_new_session=True)

    def _tree(self, proc: subprocess.Popen) -> list[psutil.Process]:
        # torchrun starts each worker in a session of its own, so a process group does not reach them.
        cached = getattr(self, "_tree_cache", None)
        if cached and cached[0] == proc.pid and len(cached[1]) == (1 if self.nproc == 1 else 1 + self.nproc):
            return cached[1]
        try:
            root = psutil.Process(proc.pid)
            tree = [root, *(root.children(recursive=True) if self.nproc > 1 else [])]
        except psutil.NoSuchProcess:
            return []
        self._tree_cache = (proc.pid, tree)
        return tree

    @staticmethod
    def _signal(procs: list[psutil.Process], sig: int) -> None:
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def _wait(self, proc: subprocess.Popen, timeout: float = LAUNCH_TIMEOUT_S) -> int:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._signal(self._tree(proc), signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"{self.name}: launch did not finish in {timeout:.0f} s; "
                                 f"stderr tail:\n{self._stderr()[-3000:]}") from None

    def _stderr(self) -> str:
        return self._stderr_path.read_text(errors="replace")

    def heartbeat(self, rank: int = 0) -> dict[str, Any] | None:
        try:
            return json.loads((self.out / f"heartbeat.rank{rank}.json").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def _launch_stopped_at(self, step: int) -> tuple[subprocess.Popen, list[psutil.Process] | None]:
        """Launch with rank 0 set to SIGSTOP itself once it has done ``step`` steps (TRAINGATE_INJECT
        ``stop@step:0``), wait for that, stop the rest of the tree too and return it, left stopped
        (None if the process exited first).

        The process stops itself, so where the kill lands does not depend on how soon this thread
        is scheduled again: on a loaded 2-core box a tiny model can run to its end between two looks
        from outside.
        """
        proc = self._launch({"TRAINGATE_INJECT": f"stop@{step}:0"})
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return proc, None
            hb = self.heartbeat(0)
            if hb is not None and hb["step"] >= step:
                try:
                    stopped = psutil.Process(hb["pid"]).status() == psutil.STATUS_STOPPED
                except psutil.NoSuchProcess:
                    stopped = False
                if stopped:
                    tree = self._tree(proc)
                    self._signal(tree, signal.SIGSTOP)
                    return proc, tree
            time.sleep(0.01)
        self._signal(self._tree(proc), signal.SIGKILL)
        raise AssertionError(f"{self.name}: step {step} not reached in {LAUNCH_TIMEOUT_S:.0f} s")

    # ------------------------------------------------------------------ checkpoints
    def checkpointer(self) -> Checkpointer:
        return Checkpointer(self.checkpoint_uri, async_save=False)

    def latest(self) -> tuple[int | None, bool]:
        """(newest valid step, whether it loads) as a resuming process would see it."""
        ck = self.checkpointer()
        step = ck.find_latest()
        if step is None:
            return None, True
        ck.load(step)
        return step, True

    def _record(self, kind: str, rc: int, start_latest: int | None, target: int | None = None) -> Interruption:
        hbs = {r: hb["step"] for r in range(self.nproc) if (hb := self.heartbeat(r)) is not None}
        latest, loads = self.latest()
        ck = self.checkpointer()
        result_path = self.out / "result.json"
        rec = Interruption(kind, rc, start_latest, target, hbs, latest, loads, self._stderr()[-6000:],
                           complete_steps=ck.list_steps(),
                           latest_manifest=ck.manifest(latest) if latest is not None else None,
                           result=json.loads(result_path.read_text()) if result_path.exists() else None,
                           seconds=time.monotonic() - self._t_launch)
        self.history.append(rec)
        return rec

    # ------------------------------------------------------------------ lifetimes
    def run(self, kind: str = "final", args: list[str] | None = None) -> Interruption:
        """Launch and let it run to its end."""
        start = self.latest()[0]
        proc = self._launch(args=args)
        rc = self._wait(proc)
        rec = self._record(kind, rc, start)
        if rc != 0:
            raise AssertionError(f"{self.name}: {kind} launch exited {rc}; stderr tail:\n{rec.stderr[-3000:]}")
        return rec

    def kill_at(self, step: int) -> Interruption:
        """SIGKILL every process of the run, from outside, once rank 0 has done ``step`` steps."""
        start = self.latest()[0]
        proc, tree = self._launch_stopped_at(step)
        if tree is None:
            raise AssertionError(f"{self.name}: exited ({proc.returncode}) before the kill at step {step}:\n"
                                 f"{self._stderr()[-3000:]}")
        rec_hb = {r: hb["step"] for r in range(self.nproc) if (hb := self.heartbeat(r)) is not None}
        self._signal(tree, signal.SIGKILL)
        rc = self._wait(proc)
        rec = self._record("kill", rc, start, step)
        rec.heartbeats = rec_hb
        return rec

    def fault_at(self, phase: str, save_step: int) -> Interruption:
        """Rank 0 SIGKILLs itself at ``phase`` of the save of ``save_step`` (TRAINGATE_FAULT)."""
        start = self.latest()[0]
        proc = self._launch({"TRAINGATE_FAULT": f"{phase}@{save_step}"})
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        rank0_pid = None
        while proc.poll() is None and time.monotonic() < deadline:
            hb = self.heartbeat(0)
            rank0_pid = hb["pid"] if hb else rank0_pid
            if rank0_pid is not None and self.nproc > 1 and not psutil.pid_exists(rank0_pid):
                # Rank 0 is gone (the node is lost): take the rest of the tree down without waiting
                # for torchrun to notice.
                self._signal(self._tree(proc), signal.SIGKILL)
            time.sleep(0.02)
        rc = self._wait(proc)
        return self._record(f"fault:{phase}", rc, start, save_step)

    def sigterm_at(self, step: int, rank: int | None = None) -> Interruption:
        """SIGTERM one process once rank 0 has done ``step`` steps: rank ``rank``'s worker, or the launcher."""
        start = self.latest()[0]
        proc, tree = self._launch_stopped_at(step)
        if tree is None:
            raise AssertionError(f"{self.name}: exited before the SIGTERM at step {step}:\n{self._stderr()[-3000:]}")
        pid = proc.pid if rank is None else self.heartbeat(rank)["pid"]
        os.kill(pid, signal.SIGTERM)  # pending until the tree continues
        self._signal(tree, signal.SIGCONT)
        rc = self._wait(proc)
        return self._record("sigterm", rc, start, step)

    # ------------------------------------------------------------------ what a run produced
    def state(self, step: int) -> dict[str, Any]:
        return self.checkpointer().load(step)

    def result(self) -> dict[str, Any]:
        return json.loads((self.out / "result.json").read_text())

    def samples(self) -> dict[int, dict[int, list[int]]]:
        """rank -> step -> sample ids, the last record of a step winning (a resumed run redoes steps)."""
        out: dict[int, dict[int, list[int]]] = {}
        for r in range(self.nproc):
            path = self.out / f"samples.rank{r}.txt"
            out[r] = parse_samples(path.read_text() if path.exists() else "")
        return out


def parse_samples(text: str) -> dict[int, list[int]]:
    steps: dict[int, list[int]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and all(p.isdigit() for p in parts):
            steps[int(parts[0])] = [int(p) for p in parts[1:]]
    return steps


def assert_state_equal(a: Any, b: Any, path: str = "state") -> None:
    """Bitwise equality of two loaded checkpoints: every tensor torch.equal, everything else ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"{path} differs (max abs diff {(a.double() - b.double()).abs().max():.3g})"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            assert_state_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: length differs"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_state_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def drive(drill: Drill, every: int, max_steps: int, faults: list[str], seed: str,
          sigterm_rank: int | None | str = "none") -> None:
    """Three SIGKILLs at seeded-random steps, one of them replaced by a self-kill mid-save at each
    phase in ``faults`` order; optionally a SIGTERM last; then run to the end."""
    rnd = random.Random(seed)
    fault_slot = rnd.randrange(3)
    faults = list(faults)
    prev = 0
    for i in range(3):
        latest = drill.latest()[0] or 0
        lo, hi = max(latest + 2, prev + 1), min(latest + 3 * every, max_steps - 2 * every)
        if i == fault_slot and faults:
            save_steps = [s for s in range(latest + every, max(hi, latest + every) + 1, every)]
            prev = rnd.choice(save_steps[:2])
            drill.fault_at(faults.pop(0), prev)
        else:
            prev = rnd.randint(lo, max(lo, hi))
            drill.kill_at(prev)
    if sigterm_rank != "none":
        latest = drill.latest()[0] or 0
        lo = max(latest + 2, prev + 1)
        drill.sigterm_at(rnd.randint(lo, max(lo, min(latest + 2 * every, max_steps - 2))), sigterm_rank)
