"""Fair share on a Slurm pool is Slurm's multifactor priority: the team that used less goes first.

Team A (account vision) uses the whole pool first; then, while A's next job holds the pool, A and B (account
language) each queue a job that needs the whole pool, A's first. When the pool frees, B's starts before A's:
Slurm's fair-share factor, not submission order. The jobs are the engine's own sbatch commands
(traingate.capacity.slurm.sbatch_command) with a `sleep` as the batch step.

Slurm's fair-tree factors follow recorded usage when slurmctld starts and then once per PriorityCalcPeriod (1 min,
its least), so when sshare does not yet rank A below B the test restarts the controller (on its saved state)
rather than wait up to a minute, then queues the contested jobs. Measured here: 26 s in all, 9 s of it until
sshare ranked A below B (a minute longer without the restart).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import yaml
from tgtest import PYTHON, TINY_DIGITS

from traingate.capacity import slurm as tslurm
from traingate.capacity.pools import parse_config
from traingate.job.stagejob import derive
from traingate.settings import Settings

POOL = "slurm-gpu"
A, B = "vision", "language"


def _pools(half_life_h: float) -> dict:
    return {"scheduling": {"half_life_h": half_life_h},
            "pools": {POOL: {"gpu": "A100-80GB", "gpus_per_node": 2, "nodes": 2, "price_per_gpu_hour": 1.0,
                             "worker": "process", "engine": "slurm",
                             "slurm": {"partition": "gpu", "gres_type": "a100"}}}}


def _submit(tmp_path: Path, team: str, name: str, sleep_s: int) -> str:
    """One whole-pool job of ``team`` (2 nodes x 2 GPUs) as the engine submits a stage, its batch step a sleep."""
    from traingate.spec import parse_spec

    tree = yaml.safe_load(TINY_DIGITS)
    tree["identity"]["team"] = team
    tree["resources"] = {"work_pool": POOL, "nodes": 2, "procs_per_node": 2, "rdzv_endpoint": "n1:29512"}
    tree["pools"] = {POOL: {"price_per_gpu_hour": 1.0, "gpus_per_node": 2}}
    tree["tracking"] = {"enabled": False}
    job = derive(parse_spec(tree), "full", run_id=name, run_dir=tmp_path / name,
                 settings=Settings.from_env({"TRAINGATE_STATE_DIR": str(tmp_path)}))
    Path(job.stage_dir).mkdir(parents=True)
    pool = parse_config(_pools(1.0)).pools[POOL].slurm
    assert pool is not None
    cmd = tslurm.sbatch_command(job, pool, python=PYTHON, time_limit_s=120, grace_s=5)
    assert cmd[-1].startswith("--wrap=") and f"--account={team}" in cmd and "--qos=research" in cmd
    r = subprocess.run([*cmd[:-1], f"--wrap=sleep {sleep_s}"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return tslurm.parse_job_id(r.stdout)


def _level_fs() -> dict[str, float]:
    """Fair tree's LevelFS per account from sshare (inf: no usage yet; lower: used more than its share)."""
    out = subprocess.run(["sshare", "-nP", "-A", f"{A},{B}", "-o", "Account,User,LevelFS"], capture_output=True,
                         text=True, check=True).stdout
    rows = [line.strip().split("|") for line in out.splitlines()]
    return {acct.strip(): float(fs) for acct, user, fs in rows if not user and fs}


def _fairshare_factor(job_id: str) -> int:
    out = subprocess.run(["sprio", "-h", "-j", job_id, "-o", "%F"], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def _state(job_id: str) -> str | None:
    """PENDING or RUNNING while the job lives; None once it ended (squeue --json lists ended jobs MinJobAge long)."""
    q = tslurm.queued_job(subprocess.run(["squeue", "--json"], capture_output=True, text=True).stdout, job_id)
    return q.state if q and q.state in ("PENDING", "RUNNING", "CONFIGURING") else None


def _wait(cond, what: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.5)


def test_when_a_saturated_pool_frees_the_team_that_used_less_starts_before_the_team_that_queued_first(
        slurm, tmp_path):
    t0 = time.monotonic()
    used = _submit(tmp_path, A, "a-used", 4)  # A uses the whole pool first
    _wait(lambda: _state(used) is None, "A's first job to end", 60)
    ranked = lambda: (fs := _level_fs()).get(A, float("inf")) < fs.get(B, float("inf"))  # noqa: E731
    if not ranked():
        # slurmctld computes the fair-tree factors as it starts, then once per PriorityCalcPeriod (1 min)
        slurm.restart_controller()
    _wait(ranked, "sshare to rank A's account below B's", 90)
    waited = time.monotonic() - t0
    holder = _submit(tmp_path, A, "a-holds", 6)  # the pool is full ...
    _wait(lambda: _state(holder) == "RUNNING", "A's job to hold the pool", 30)
    a_job = _submit(tmp_path, A, "a-next", 2)  # ... and both teams queue, A first
    b_job = _submit(tmp_path, B, "b-next", 2)
    assert _state(a_job) == "PENDING" and _state(b_job) == "PENDING"
    fa, fb = _fairshare_factor(a_job), _fairshare_factor(b_job)
    assert fb > fa, (fa, fb)  # sprio: why B goes first
    _wait(lambda: _state(b_job) == "RUNNING", "B's job to start", 60)
    assert _state(a_job) == "PENDING"  # the pool holds one whole-pool job: A's waits for B's
    _wait(lambda: _state(a_job) is None, "A's job to run and end", 60)
    starts = {j: tslurm.accounted_job(subprocess.run(["sacct", "-j", j, "--json"], capture_output=True,
                                                     text=True).stdout, j) for j in (a_job, b_job)}
    assert starts[b_job].start < starts[a_job].start
    ahead = starts[a_job].start - starts[b_job].start
    print(f"\nfair share: sprio fair-share factor A {fa}, B {fb}; B started {ahead:.0f} s before A; {waited:.0f} s "
          f"until Slurm's fair-share factors ranked A below B, {time.monotonic() - t0:.0f} s in all")


def test_pools_show_says_when_the_configs_half_life_differs_from_slurms_priority_decay_half_life(slurm, tmp_path,
                                                                                                capsys):
    from flows.cli import main

    def show(half_life_h: float) -> subprocess.CompletedProcess:
        """`traingate pools show` in this process (a `traingate` process each would pay its imports again)."""
        config = tmp_path / f"pools-{half_life_h:g}.yaml"
        config.write_text(yaml.safe_dump(_pools(half_life_h)))
        capsys.readouterr()
        code = main(["pools", "show", str(config)])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["traingate", "pools", "show", str(config)], code, out, err)

    agreed = show(1.0)  # the test cluster's PriorityDecayHalfLife=01:00:00
    assert agreed.returncode == 0 and "half_life" not in agreed.stdout, agreed
    differs = show(24.0)
    assert differs.returncode == 0, differs
    line = next(x for x in differs.stdout.splitlines() if "half_life" in x)
    assert "scheduling.half_life_h = 24 h" in line and "PriorityDecayHalfLife = 01:00:00 (1 h)" in line, line
