"""The Slurm engine's mapping: traingate's concepts in Slurm's words, and Slurm's answers back.

Plain functions of plain data (a StageJob, a pool's ``slurm:`` section, the text the Slurm CLI
printed); the commands are run by :mod:`traingate.capacity.slurm_cli`. Slurm does gang
scheduling, priority, quotas, fair share, backfill and preemption; what is here is the mapping:

- one stage attempt is one batch job over ``job.nodes`` whole nodes, one task per node (its
  torchrun agent), ``gpu:<type>:<procs_per_node>`` each; team -> ``--account``, priority class ->
  ``--qos``; ``--time`` from the canary's measured step time when there is one (backfill needs it);
  ``--requeue --signal=B:TERM@<grace>``: a preempted job's batch step gets SIGTERM, the supervisor
  writes its emergency checkpoint, and the job requeues itself and resumes from it;
- a job's state (squeue while it lives, sacct after) -> a phase while it lives and an
  :class:`Ending` once it is final (a job seen COMPLETING, PREEMPTED or NODE_FAIL may still come back
  requeued: only sacct's state of a job squeue no longer lists is final);
- sbatch's refusals -> one line naming the account, QOS, partition or gres and the fix.

Slurm 22.05's JSON: ``squeue --json`` and ``sinfo --json`` ignore ``-j``/``--me`` filters (we filter
here); sacct lists a job about a second after it ends.

>>> parse_time_limit("1-02:00:00"), parse_time_limit("UNLIMITED"), parse_time_limit("30")
(93600, None, 1800)
>>> ending("NODE_FAIL"), ending("RUNNING")
(<Ending.NODE_LOST: 'node_lost'>, None)
"""

from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from traingate.capacity.pools import SlurmPool
from traingate.job.stagejob import StageJob
from traingate.spec import SpecError
from traingate.units import UTC_LABEL, duration, utc

BATCH_MODULE = "traingate.ladder.slurm_batch"
WARM_MODULE = "traingate.runtime.warm"
JOB_FILE = "slurm_job.json"  # the StageJob the batch step runs (the submitter writes it; job.json is per launch)
RECORD_FILE = "slurm.json"  # the stage's Slurm job id(s): who submitted what, when
STOP_FILE = "slurm_stop"  # written before traingate itself signals its job: a stop, not a preemption
OUTPUT = "slurm-%j.out"  # the batch step's own output, in the stage directory
SIGNALLED = "Slurm signalled the batch step"  # the supervisor's stop reason after --signal/scancel
TIME_MARGIN = 1.5  # the canary's step time x remaining steps x this, plus START_S
START_S = 300.0  # start-up, checkpoint loads, the emergency checkpoint


class SlurmError(SpecError):
    """Slurm refused or could not do what traingate asked. One line: what, the value, the fix."""


class Unreachable(SlurmError):
    """The Slurm controller (or its database) did not answer; the same command may succeed later."""


class NeverStarts(SlurmError):
    """A submitted job pends for a reason that waiting does not clear."""


# What the CLI says when slurmctld (or slurmdbd, for sacct) does not answer: worth a retry. In JSON mode
# squeue/sinfo exit 0 after ~MessageTimeout with {"errors": [{"error": "Unable to contact slurm controller..."}]}.
UNREACHABLE = (
    "unable to contact slurm controller",
    "socket timed out",
    "zero bytes were transmitted",
    "connection refused",
    "slurm_persist_conn_open",
    "unable to connect to database",
    "communication connection failure",
    "slurmctld is not responding",
    "failed while looking for jobs",
)


def unreachable(text: str) -> bool:
    return any(u in text.lower() for u in UNREACHABLE)


class Ending(StrEnum):
    """How a Slurm job ended for good (sacct's final state)."""

    COMPLETED = "completed"  # the batch step exited 0: the supervisor's verdict is in supervisor.json
    FAILED = "failed"  # the batch step exited non-zero
    CANCELLED = "cancelled"  # scancel (an admin, or traingate stopping it)
    PREEMPTED = "preempted"  # killed by a higher QOS without requeue (PreemptMode=CANCEL)
    NODE_LOST = "node_lost"  # NODE_FAIL / BOOT_FAIL and not requeued
    TIMEOUT = "timeout"  # its --time ran out
    OOM = "oom"  # the cgroup's memory limit


_ENDINGS = {
    "COMPLETED": Ending.COMPLETED,
    "FAILED": Ending.FAILED,
    "CANCELLED": Ending.CANCELLED,
    "PREEMPTED": Ending.PREEMPTED,
    "NODE_FAIL": Ending.NODE_LOST,
    "BOOT_FAIL": Ending.NODE_LOST,
    "TIMEOUT": Ending.TIMEOUT,
    "DEADLINE": Ending.TIMEOUT,
    "OUT_OF_MEMORY": Ending.OOM,
}
# Pending reasons that never clear by waiting: the job asks for more than its partition allows.
NEVER_STARTS = {
    "PartitionNodeLimit": "more nodes than the partition has (lower resources.nodes)",
    "PartitionTimeLimit": "a --time over the partition's MaxTime (lower the stage's max_steps)",
    "BadConstraints": "a node configuration the partition does not have (check the pool's sbatch_args)",
    "QOSMaxWallDurationPerJobLimit": "a --time over the QOS's MaxWall (use another priority class)",
    "AssocMaxWallDurationPerJobLimit": "a --time over the account's MaxWall",
    "QOSMaxGRESPerJob": "more GPUs than the QOS allows one job (fewer nodes or processes per node)",
    "AssocMaxGRESPerJob": "more GPUs than the account allows one job (fewer nodes or processes per node)",
}
LIVE = frozenset(
    {
        "PENDING",
        "RUNNING",
        "SUSPENDED",
        "CONFIGURING",
        "COMPLETING",
        "REQUEUED",
        "REQUEUE_FED",
        "REQUEUE_HOLD",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "STOPPED",
        "RESV_DEL_HOLD",
    }
)


def ending(state: str) -> Ending | None:
    """The final ending a state names, or None for a state a job lives on from (or may be requeued from).

    Only meaningful for sacct's state of a job squeue no longer lists: squeue may show NODE_FAIL or
    PREEMPTED for a moment before the requeue puts it back to PENDING.
    """
    return _ENDINGS.get(_state_word(state))


def _state_word(state: Any) -> str:
    # 22.05 gives a string ("CANCELLED by 0" in sacct's text mode; a list of flags in later versions).
    if isinstance(state, list):
        state = state[0] if state else ""
    return str(state or "").split()[0].upper() if state else ""


# ------------------------------------------------------------------------------------------- sbatch
def gres(pool: SlurmPool, procs_per_node: int) -> str:
    return f"gpu:{pool.gres_type}:{procs_per_node}" if pool.gres_type else f"gpu:{procs_per_node}"


def job_name(job: StageJob) -> str:
    return f"tg-{job.run_id}-{job.stage}"


def sbatch_command(
    job: StageJob,
    pool: SlurmPool,
    *,
    python: str,
    time_limit_s: float,
    grace_s: float,
    resume: bool = False,
    zygote_log: str | None = None,
) -> list[str]:
    """The sbatch command of one attempt of ``job``: its batch step is ``python -m slurm_batch --job FILE``.
    ``zygote_log``: a warm stage's; its zygote starts ahead of the batch step (``python -m traingate.runtime.warm
    --ahead LOG`` execs into it), so the zygote's imports run beside the batch step's own.

    >>> from traingate.spec import load_spec_text
    >>> from traingate.settings import Settings
    >>> from traingate.job.stagejob import derive
    >>> spec = load_spec_text("identity: {experiment: e, owner: o, team: vision, purpose: p}\\n"
    ...   "recipe: {name: digits-cnn}\\nresources: {nodes: 2, procs_per_node: 2, rdzv_endpoint: 'h:29500'}")
    >>> job = derive(spec, "full", run_id="r1", run_dir="/s/r1", settings=Settings.from_env({}))
    >>> cmd = sbatch_command(job, SlurmPool(partition="gpu", gres_type="a100"), python="py", time_limit_s=3600,
    ...                      grace_s=30)
    >>> cmd[2:6]
    ['--partition=gpu', '--nodes=2', '--ntasks-per-node=1', '--gres=gpu:a100:2']
    >>> cmd[6:11]
    ['--account=vision', '--qos=research', '--time=60', '--requeue', '--signal=B:TERM@30']
    >>> cmd[-1]
    '--wrap=exec py -m traingate.ladder.slurm_batch --job /s/r1/full/slurm_job.json'
    """
    stage_dir = Path(job.stage_dir)
    batch = [python, "-m", BATCH_MODULE, "--job", str(stage_dir / JOB_FILE), *(["--resume"] if resume else [])]
    if zygote_log is not None:
        batch = [python, "-m", WARM_MODULE, "--ahead", zygote_log, *batch]
    return [
        "sbatch",
        "--parsable",
        f"--partition={pool.partition}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",
        f"--gres={gres(pool, job.procs_per_node)}",
        f"--account={job.team}",
        f"--qos={job.priority}",
        f"--time={max(1, math.ceil(time_limit_s / 60))}",
        "--requeue",
        f"--signal=B:TERM@{max(1, round(grace_s))}",
        f"--job-name={job_name(job)}",
        f"--output={stage_dir / OUTPUT}",
        "--open-mode=append",  # every allocation's
        f"--chdir={stage_dir}",
        *pool.sbatch_args,
        # exec: the batch shell IS the python process, so --signal=B:TERM reaches the supervisor itself.
        "--wrap=exec " + shlex.join(batch),
    ]


def time_limit_s(job: StageJob, step_s: float | None, done_steps: int, max_time_s: int | None) -> float:
    """The job's ``--time``: the canary's step time x the steps left x a margin, plus start-up; without a
    measured step time, the stage's own timeout. Capped by the stage's timeout; an estimate over the
    partition's MaxTime is refused (backfill would never fit it, and Slurm would kill it half way).

    >>> from types import SimpleNamespace as NS
    >>> job = NS(max_steps=1000, timeout_s=36000.0, stage="full", spec=NS(resources=NS(work_pool="p")))
    >>> time_limit_s(job, 0.5, 200, None), time_limit_s(job, None, 0, 7200)
    (900.0, 7200)
    >>> time_limit_s(job, 20.0, 0, 7200)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    traingate.capacity.slurm.SlurmError: full needs about 30300 s (canary step time 20 s x 1000 steps ... 7200 s; ...
    """
    left = max(0, job.max_steps - done_steps)
    if step_s is None:
        return min(job.timeout_s, max_time_s) if max_time_s is not None else job.timeout_s
    need = step_s * left * TIME_MARGIN + START_S
    if max_time_s is not None and need > max_time_s:
        raise SlurmError(
            f"{job.stage} needs about {need:.0f} s (canary step time {step_s:g} s x {left} steps left x "
            f"{TIME_MARGIN:g} + {START_S:.0f} s start-up) but partition MaxTime is {max_time_s} s; lower "
            f"stages.{job.stage}.max_steps, use a partition with a longer MaxTime, or ask the admin to "
            "raise it"
        )
    return min(need, job.timeout_s)


def parse_time_limit(text: str) -> int | None:
    """Slurm's ``[days-]hh:mm:ss`` / ``mm:ss`` / ``mm`` in seconds; None for UNLIMITED/INFINITE."""
    text = text.strip()
    if text.upper() in ("UNLIMITED", "INFINITE", "NONE", ""):
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if len(parts) == 1:
        h, m, s = 0, parts[0], 0
    elif len(parts) == 2:
        h, m, s = (parts[0], parts[1], 0) if days else (0, parts[0], parts[1])
    else:
        h, m, s = parts
    return (int(days) if days else 0) * 86400 + h * 3600 + m * 60 + s


def partition_max_time(show_partition: str) -> int | None:
    """MaxTime from ``scontrol show partition NAME -o``, in seconds (None: unlimited)."""
    m = re.search(r"\bMaxTime=(\S+)", show_partition)
    return parse_time_limit(m.group(1)) if m else None


def refusal(stderr: str, job: StageJob, pool: SlurmPool) -> str:
    """sbatch's refusal as one line: what Slurm said, which of the job's values it is about, and the fix."""
    said = (
        " ".join(line.removeprefix("sbatch: error: ").strip() for line in stderr.strip().splitlines() if line.strip())
        or "no reason given"
    )
    low = said.lower()
    if "invalid account" in low:
        fix = (
            f"account {job.team!r} (identity.team) is not associated with this user on partition "
            f"{pool.partition!r}; ask the Slurm admin: sacctmgr add user $USER account={job.team}, or run as a "
            "member of that team"
        )
    elif "invalid qos" in low:
        fix = (
            f"QOS {job.priority!r} (resources.priority) is not granted to account {job.team!r}; use a priority "
            f"class the account may use, or ask the Slurm admin: sacctmgr modify user $USER set qos+={job.priority}"
        )
    elif "invalid partition" in low:
        fix = f"partition {pool.partition!r} (the pool's slurm.partition) does not exist; fix the pools config"
    elif "gres" in low or "generic resource" in low:
        fix = (
            f"--gres={gres(pool, job.procs_per_node)} is not available on partition {pool.partition!r}; fix the "
            "pool's slurm.gres_type or lower resources.procs_per_node"
        )
    elif "node configuration is not available" in low or "node count specification invalid" in low:
        fix = (
            f"{job.nodes} node(s) with {gres(pool, job.procs_per_node)} do not exist in partition "
            f"{pool.partition!r}; lower resources.nodes / resources.procs_per_node or use a larger pool"
        )
    elif "time limit" in low:
        fix = f"--time is over partition {pool.partition!r}'s MaxTime or the QOS's; lower stages.{job.stage}.max_steps"
    elif "qos" in low or "accounting" in low or "association" in low:
        fix = (
            f"account {job.team!r} with QOS {job.priority!r} is over a limit of its association or QOS; ask the "
            "Slurm admin (sacctmgr show assoc / show qos) or use another priority class"
        )
    else:
        fix = "see the Slurm admin; `sbatch --test-only` with the same options shows the same refusal"
    return f"sbatch refused {job.stage} of run {job.run_id}: {said}; {fix}"


def associations(show_assoc: str) -> dict[str, set[str]]:
    """``sacctmgr -nP show assoc user=U format=account,qos`` -> {account: QOS names it grants the user}.

    >>> sorted((a, sorted(q)) for a, q in associations("vision|production,research\\nlanguage|research\\n").items())
    [('language', ['research']), ('vision', ['production', 'research'])]
    """
    out: dict[str, set[str]] = {}
    for line in show_assoc.splitlines():
        account, _, qos = line.strip().partition("|")
        if account:
            out.setdefault(account, set()).update(q for q in qos.split(",") if q)
    return out


def entitlement_problem(assocs: dict[str, set[str]], user: str, team: str, priority: str) -> str | None:
    """Why Slurm would refuse ``user`` submitting for account ``team`` with QOS ``priority``, as one line; None: it
    would not (Slurm's associations are the entitlements; this reads them, it does not decide them).

    >>> a = {"language": {"research"}}
    >>> entitlement_problem(a, "bob", "language", "research") is None
    True
    >>> entitlement_problem(a, "bob", "vision", "research")  # doctest: +ELLIPSIS
    "Slurm user 'bob' has no association with account 'vision' (identity.team = 'vision'; bob's accounts: ...
    >>> entitlement_problem(a, "bob", "language", "urgent")  # doctest: +ELLIPSIS
    "Slurm user 'bob' may not use QOS 'urgent' on account 'language' (resources.priority = 'urgent'; ...
    """
    if team not in assocs:
        mine = ", ".join(sorted(assocs)) or "none"
        return (
            f"Slurm user {user!r} has no association with account {team!r} (identity.team = {team!r}; "
            f"{user}'s accounts: {mine}); set identity.team to one of them, run as a member of {team}, or ask "
            f"the Slurm admin: sacctmgr add user {user} account={team}"
        )
    if priority not in assocs[team]:
        granted = ", ".join(sorted(assocs[team])) or "none"
        return (
            f"Slurm user {user!r} may not use QOS {priority!r} on account {team!r} (resources.priority = "
            f"{priority!r}; granted: {granted}); use one of those, or ask the Slurm admin: sacctmgr modify user "
            f"{user} where account={team} set qos+={priority}"
        )
    return None


def half_life_mismatch(show_config: str, half_life_h: float) -> str | None:
    """The pools config's ``scheduling.half_life_h`` against the controller's ``PriorityDecayHalfLife``
    (``scontrol show config``): one line when they differ, None when they agree (or Slurm does not say).

    >>> half_life_mismatch("PriorityDecayHalfLife   = 01:00:00", 1.0) is None
    True
    >>> half_life_mismatch("PriorityDecayHalfLife   = 7-00:00:00", 24.0)  # doctest: +ELLIPSIS
    "fair share: scheduling.half_life_h = 24 h but ... PriorityDecayHalfLife = 7-00:00:00 (168 h); ...
    """
    m = re.search(r"^PriorityDecayHalfLife\s*=\s*(\S+)", show_config, re.MULTILINE)
    if not m:
        return None
    seconds = parse_time_limit(m.group(1))
    slurm_h = None if seconds is None or seconds == 0 else seconds / 3600.0
    if slurm_h is not None and math.isclose(slurm_h, half_life_h, rel_tol=1e-3):
        return None
    shown = "no decay" if slurm_h is None else f"{slurm_h:g} h"
    return (
        f"fair share: scheduling.half_life_h = {half_life_h:g} h but Slurm decays usage with "
        f"PriorityDecayHalfLife = {m.group(1)} ({shown}); Slurm's is the one that orders jobs: set "
        "scheduling.half_life_h to it, or ask the Slurm admin to set PriorityDecayHalfLife in slurm.conf"
    )


def parse_job_id(stdout: str) -> str:
    """``sbatch --parsable`` prints ``ID`` or ``ID;cluster``."""
    return stdout.strip().splitlines()[-1].split(";")[0].strip()


# ------------------------------------------------------------------------------------------- views
@dataclass(frozen=True)
class QueuedJob:
    """One job as squeue shows it."""

    job_id: str
    name: str
    state: str  # PENDING, RUNNING, COMPLETING, ...
    reason: str  # why it pends (Priority, Resources, AssocGrpGRES, QOS...), "None" when running
    account: str
    qos: str
    partition: str
    user: str
    nodes: str  # the node list ("n[1-2]"), empty while pending
    node_count: int
    start_time: int | None  # epoch s: when it started, or Slurm's estimate while pending (None: unknown)
    submit_time: int | None
    restarts: int  # how many times it was requeued
    time_limit_s: int | None

    @property
    def pending(self) -> bool:
        return self.state == "PENDING"


@dataclass(frozen=True)
class NodeView:
    """One node as sinfo shows it."""

    name: str
    addr: str
    state: str  # idle, mixed, allocated, down, drained, draining...
    reason: str  # an admin's or traingate's drain reason
    gres: str  # "gpu:a100:2"
    gres_used: str
    partitions: tuple[str, ...]


@dataclass(frozen=True)
class AccountedJob:
    """One job as sacct shows it (the allocation, not its steps)."""

    job_id: str
    state: str
    reason: str
    exit_code: int | None
    signal: int | None
    start: int | None
    end: int | None
    elapsed_s: int | None
    nodes: str
    restarts: int


def _load(text: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise SlurmError(f"{what} --json printed no JSON ({e}); is the Slurm client 22.05 or newer?") from None
    errors = [e for e in data.get("errors") or [] if e]
    if errors:
        said = "; ".join(
            " ".join(str(v) for k, v in e.items() if k in ("description", "error", "source"))
            if isinstance(e, dict)
            else str(e)
            for e in errors
        )
        raise (Unreachable if unreachable(said) else SlurmError)(f"{what}: {said}")
    return data


def _num(v: Any) -> int | None:
    """22.05 numbers are plain; later versions wrap them ({"set": true, "number": N})."""
    if isinstance(v, dict):
        return int(v["number"]) if v.get("set", True) and not v.get("infinite") and "number" in v else None
    return int(v) if isinstance(v, (int, float)) else None


def queued_jobs(text: str) -> list[QueuedJob]:
    """Every job ``squeue --json`` printed (it ignores filters: pick yours with :func:`queued_job`)."""
    out = []
    for j in _load(text, "squeue").get("jobs") or []:
        start = _num(j.get("start_time"))
        tl = _num(j.get("time_limit"))
        out.append(
            QueuedJob(
                job_id=str(j["job_id"]),
                name=j.get("name") or "",
                state=_state_word(j.get("job_state")),
                reason=str(j.get("state_reason") or "None"),
                account=j.get("account") or "",
                qos=j.get("qos") or "",
                partition=j.get("partition") or "",
                user=j.get("user_name") or str(j.get("user_id", "")),
                nodes=j.get("nodes") or "",
                node_count=_num(j.get("node_count")) or 0,
                start_time=start or None,
                submit_time=_num(j.get("submit_time")),
                restarts=_num(j.get("restart_cnt")) or 0,
                time_limit_s=tl * 60 if tl is not None else None,
            )
        )
    return out


def queued_job(text: str, job_id: str) -> QueuedJob | None:
    return next((j for j in queued_jobs(text) if j.job_id == str(job_id)), None)


def nodes(text: str, partition: str | None = None) -> list[NodeView]:
    """The nodes ``sinfo --json`` printed, those of ``partition`` when given."""
    out = []
    for n in _load(text, "sinfo").get("nodes") or []:
        parts = tuple(n.get("partitions") or ())
        if partition is not None and partition not in parts:
            continue
        state = _state_word(n.get("state")).lower()
        flags = [str(f).lower() for f in n.get("state_flags") or []]
        if "drain" in flags:
            state = "drained" if state in ("idle", "down") else "draining"
        out.append(
            NodeView(
                name=n.get("name") or n.get("hostname"),
                addr=n.get("address") or "",
                state=state,
                reason=n.get("reason") or "",
                gres=n.get("gres") or "",
                gres_used=n.get("gres_used") or "",
                partitions=parts,
            )
        )
    return out


def accounted_job(text: str, job_id: str) -> AccountedJob | None:
    """The allocation's record in ``sacct -j ID --json`` (the newest when a requeue left several)."""
    found = [j for j in _load(text, "sacct").get("jobs") or [] if str(j.get("job_id")) == str(job_id)]
    if not found:
        return None
    j = max(found, key=lambda j: _num((j.get("time") or {}).get("submission")) or 0)
    state = j.get("state") or {}
    ec = j.get("exit_code") or {}
    sig = (ec.get("signal") or {}).get("signal_id") if isinstance(ec.get("signal"), dict) else None
    t = j.get("time") or {}
    return AccountedJob(
        job_id=str(j["job_id"]),
        state=_state_word(state.get("current")),
        reason=str(state.get("reason") or ""),
        exit_code=_num(ec.get("return_code")),
        signal=_num(sig),
        start=_num(t.get("start")) or None,
        end=_num(t.get("end")) or None,
        elapsed_s=_num(t.get("elapsed")),
        nodes=j.get("nodes") or "",
        restarts=_num(j.get("restart_cnt")) or 0,
    )


def node_addresses(show_node: str) -> dict[str, str]:
    """NodeName -> NodeAddr from ``scontrol show node -o`` (one line per node)."""
    out = {}
    for line in show_node.splitlines():
        name = re.search(r"\bNodeName=(\S+)", line)
        addr = re.search(r"\bNodeAddr=(\S+)", line)
        if name and addr:
            out[name.group(1)] = addr.group(1)
    return out


def preempted(show_job: str) -> bool:
    """Whether ``scontrol show job -o ID`` says a higher priority job preempted it (PreemptTime is set). An admin's
    scancel and the time limit's signal leave it None; the job's state shows COMPLETING in all three.

    >>> preempted("JobId=7 JobState=COMPLETING PreemptEligibleTime=2026-11-25T15:00:01 PreemptTime=None")
    False
    >>> preempted("JobId=7 JobState=COMPLETING PreemptEligibleTime=2026-11-25T15:00:01 PreemptTime=2026-11-25T15:01:09")
    True
    """
    m = re.search(r"\bPreemptTime=(\S+)", show_job)
    return m is not None and m.group(1) not in ("None", "Unknown", "(null)")


def describe_pending(j: QueuedJob, now: float) -> str:
    """Why a pending job waits, in Slurm's words, and Slurm's start estimate."""
    when = ""
    if j.start_time:
        when = (
            f", Slurm's estimate: start in {max(0, j.start_time - now):.0f} s"
            if j.start_time > now
            else ", Slurm's estimate: start now"
        )
    return f"Slurm job {j.job_id} pending ({j.reason}){when}"


def queue_lines(pool_name: str, pool: SlurmPool, jobs: list[QueuedJob], now: float) -> list[str]:
    """A Slurm pool in `traingate queue`: its partition's live jobs as Slurm sees them, running first, then
    pending in Slurm's order of expected start, each with Slurm's pending reason and start estimate.

    >>> j = QueuedJob("7", "tg-r1-full", "PENDING", "AssocGrpGRES", "vision", "research", "gpu", "root", "", 2,
    ...               None, 100, 0, 3600)
    >>> print("\\n".join(queue_lines("p", SlurmPool(partition="gpu"), [j], 160.0)))  # doctest: +NORMALIZE_WHITESPACE
    pool p (Slurm partition gpu): 0 running, 1 pending
      pending  7        tg-r1-full                 research    vision       2 node(s)  queued  1970-01-01 00:01:40 UTC
      waited  1:00  start unknown (AssocGrpGRES)
    """
    mine = [j for j in jobs if j.partition == pool.partition and ending(j.state) is None]
    running = sorted((j for j in mine if not j.pending), key=lambda j: j.start_time or 0)
    pending = sorted((j for j in mine if j.pending), key=lambda j: (j.start_time or float("inf"), j.submit_time or 0))
    out = [f"pool {pool_name} (Slurm partition {pool.partition}): {len(running)} running, {len(pending)} pending"]
    for j in running:
        started = j.start_time or now
        out.append(
            f"  {j.state.lower():<8} {j.job_id:<8} {j.name:<26} {j.qos:<11} {j.account:<10} {j.nodes:>11}  "
            f"started {utc(started)} {UTC_LABEL}  for {duration(now - started):>8}"
        )
    for j in pending:
        est = (
            "unknown" if not j.start_time else ("now" if j.start_time <= now else f"in {duration(j.start_time - now)}")
        )
        submitted = j.submit_time or now
        out.append(
            f"  pending  {j.job_id:<8} {j.name:<26} {j.qos:<11} {j.account:<10} {j.node_count:>3} node(s)  "
            f"queued  {utc(submitted)} {UTC_LABEL}  waited {duration(now - submitted):>5}  start {est} ({j.reason})"
        )
    return out


def node_lines(pool_name: str, pool: SlurmPool, views: list[NodeView]) -> list[str]:
    """A Slurm pool's nodes in `traingate pools show`: state, GPUs in use, a drain's reason.

    >>> n = NodeView("n1", "10.0.0.1", "drained", "traingate:ecc-errors", "gpu:a100:2", "gpu:a100:0(IDX:N/A)", ("gpu",))
    >>> print("\\n".join(node_lines("p", SlurmPool(partition="gpu"), [n])))
    pool p (Slurm partition gpu): 1 node(s), 0 usable
      n1       10.0.0.1        drained    gpu:a100:2   used gpu:a100:0  reason: traingate:ecc-errors
    """
    usable = [v for v in views if v.state in ("idle", "mixed", "allocated", "completing")]
    out = [f"pool {pool_name} (Slurm partition {pool.partition}): {len(views)} node(s), {len(usable)} usable"]
    for v in views:
        used = v.gres_used.split("(")[0]
        out.append(
            f"  {v.name:<8} {v.addr:<15} {v.state:<10} {v.gres:<12} used {used:<10}"
            + (f"  reason: {v.reason}" if v.reason else "")
        )
    return out
