"""A real Slurm 22.05 cluster on one machine: controller, accounting and two GPU nodes.

Developer use (root, Debian's slurmctld slurmd slurm-client slurmdbd munge mariadb-server,
installed by `make test-deps`):

    .venv/bin/python tests/slurm/cluster.py up /tmp/mycluster
    # prints `export SLURM_CONF=... PATH=...`; paste them into another shell, then
    # sinfo; sbatch -A vision --gpus-per-node=1 -o /tmp/mycluster/shared/%j.out --wrap 'env | grep GPU'
    # Ctrl-C (or SIGTERM) in the first shell tears everything down;
    # `python tests/slurm/cluster.py reap` cleans up after a cluster whose process was killed.

Tests use the session fixture `slurm_cluster` (tests/slurm/conftest.py) instead.

What runs, with configs, logs and state under BASE (`SlurmCluster.start(BASE)`): munged with its
own key and socket, MariaDB with a private datadir on /dev/shm reached only through its Unix
socket in BASE (no grant tables: nothing but root can open that socket), slurmdbd, slurmctld on a
bridge address, and one slurmd per node,
each in its own network namespace (`nsenter --net`, same filesystem and users) with two fake
a100 GPUs (character devices 195:N, so the devices cgroup can fence them). Teardown kills every
process left in the node namespaces, removes the namespaces, the bridge, the job cgroups and the
OS users `tgalice`/`tgbob` (when no other cluster of this module is still up); it leaves BASE's
logs and configs and deletes its database. A cluster whose owning process died is torn down by
the next start() or by `reap` (each cluster registers itself under /run/traingate-slurm).
Concurrent clusters (other sessions) get their own subnet 10.88.T.0/24, cluster name tgsT, job
ids from T*100000 (so their job cgroups never collide) and ports.

The cluster, as tests see it:
- partition `gpu` (default, MaxTime 2 h), nodes n1 and n2, each 8 CPUs and `gpu:a100:2`.
- QOS research (the default), production, urgent (Preempt=research,production, highest
  priority; no GraceTime): an urgent job preempts within ~1 s; every process of the victim gets
  SIGTERM at once and SIGKILL `KillWait` (5) s later: that is its window to checkpoint. Its
  `--signal=B:SIG@N` is sent too (preempt_send_user_signal) but a SIG other than TERM does not
  always arrive (seen 1 in 4: slurmd handled the kill first). Then it is requeued, even when it
  exited 0 on the SIGTERM (PreemptMode=REQUEUE; `set_preempt_mode` switches to CANCEL), and pends
  with reason BeginTime and restart_cnt 1 until it may start again cred_expire (10) + 1 s later.
  With a QOS GraceTime (`cluster.sacctmgr("modify", "qos", ...)`), 22.05 signals a batch-only job
  only when the grace ends.
- Timers are short so the tests wait little on Slurm itself: cred_expire 10 s (Slurm's minimum is 5; a
  launch must reach slurmd within it, which 10 s leaves room for on a loaded machine), SlurmdTimeout
  10 s (a killed slurmd's node is DOWN ~10 s later and its jobs requeued), MessageTimeout 10 s
  (Slurm's default: how long a client such as squeue waits for a stopped controller).
- `--time` over the partition's MaxTime is refused at submit (EnforcePartLimits=ALL).
- Every task runs with TMPDIR=BASE/jobtmp/JOBID, removed by the epilog when the job ends.
- accounts vision and language; root may use both and every QOS; tgalice: vision with
  research,production; tgbob: language with research only.
- priority/multifactor (fair share and QOS weights), sched/backfill, select/cons_tres,
  AccountingStorageEnforce=associations,limits,qos, GrpTRES on gres/gpu.
- Users reach a shared directory: BASE is made 0711 and `cluster.shared_dir(name)` gives a
  sticky, world-writable directory under BASE/shared (BASE's ancestors must be traversable:
  use a directory made by `tempfile.mkdtemp()`, not pytest's 0700 basetemp).
- Run a command as a test user with `cluster.users["tgalice"].run([...])` (or `.argv(...)`
  for Popen): it carries `cluster.env`, the user's own HOME and, first on PATH, BASE/pyenv/bin:
  `python` and `torchrun` with this interpreter's packages (the venv's own python may sit under
  /root, which other users cannot enter). Jobs inherit that environment (sbatch --export=ALL).
- The nodes share the host's name, which resolves to 127.0.0.1: processes that must reach
  another node (torchrun) use the node addresses (`cluster.nodes[i].addr`, interface
  `eth0` in every node namespace).

Measured here (2 cores shared with other busy sessions, load average ~10):
- cold start, accounts/QOS/users included: 6.5-8 s (slurmdbd's tables ~0.6 s with MariaDB's
  datadir on /dev/shm, 3.5 s on disk; 4 sacctmgr sessions ~4.5 s; slurmctld ~1.3 s);
- teardown 1.6-2.8 s;
- RSS ~90-97 MiB in all: mariadbd 54-58, slurmctld 8-11 (+ slurmscriptd 2.5), slurmdbd 9,
  slurmd 7.3 per node, munged 4;
- tests/slurm/test_cluster.py: 46-61 s (the 2-node torchrun job alone 14-24 s, once 37 s).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

BINARIES = ("munged", "mariadbd", "mariadb", "slurmdbd", "slurmctld", "slurmd", "sacctmgr", "sbatch", "srun",
            "squeue", "sinfo", "sacct", "scontrol", "scancel", "nsenter", "ip", "setpriv", "useradd", "userdel")
SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
REGISTRY = Path("/run/traingate-slurm")
NO_VAL = 4294967294                 # the uid slurmctld gives a user name it cannot resolve
USER_MARK = "traingate slurm test user"      # GECOS of users this module creates (and only deletes)
MYSQL_SYSTEM_TABLES = "/usr/share/mysql/mysql_system_tables.sql"
GPU_MAJOR = 195                              # NVIDIA's character major; minors are unique per GPU


def missing_binaries() -> list[str]:
    """Binaries the cluster needs that are not on PATH (with the sbin directories added)."""
    return [b for b in BINARIES if shutil.which(b, path=SBIN_PATH) is None]


class ClusterError(RuntimeError):
    """A daemon failed to start or a Slurm command failed; the message carries its output."""


@dataclass(frozen=True)
class Node:
    name: str            # Slurm node name (slurmd -N)
    addr: str            # IPv4 address inside its namespace
    netns: str           # /run/netns/<netns>
    ifname: str          # interface holding `addr` inside the namespace
    host_ifname: str     # the veth's other end, on the bridge in the root namespace
    gpu_devices: tuple[str, ...]   # its fake GPUs: character devices 195:N under BASE/dev


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    account: str
    qos: tuple[str, ...]
    home: Path
    env: dict[str, str] = field(repr=False, compare=False)

    def argv(self, *cmd: str) -> list[str]:
        """`cmd` as this user, for Popen (pass `env=user.env`); setpriv keeps the environment as given."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--", *cmd]

    def run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        """subprocess.run as this user with the cluster's environment and the user's HOME; text output captured."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("env", self.env)
        kw.setdefault("cwd", str(self.home))
        return subprocess.run(self.argv(*cmd), **kw)


def _alive(pid: int) -> bool:
    """True while `pid` runs; a killed daemon lingers as a zombie, so read its state."""
    try:
        proc_stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return proc_stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def _wait(pred, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def _sh(*argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), capture_output=True, text=True, **kw)
    if check and r.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} exited {r.returncode}: {(r.stdout + r.stderr).strip()}")
    return r


class SlurmCluster:
    partition = "gpu"
    gres_type = "a100"
    gpus_per_node = 2
    cpus_per_node = 8
    max_time = "02:00:00"
    accounts = ("vision", "language")
    qos_names = ("research", "production", "urgent")
    default_qos = "research"
    user_specs = {"tgalice": ("vision", ("research", "production")),
                  "tgbob": ("language", ("research",))}

    def __init__(self, base: Path, tag: int):
        self.base = Path(base).resolve()
        self.tag = tag
        self.name = f"tgs{tag}"                       # Slurm cluster name (stored lower-case)
        self.subnet = f"10.88.{tag}"
        self.ctl_addr = f"{self.subnet}.1"
        self.bridge = f"tgsb{tag}"
        self.hostname = socket.gethostname().split(".")[0]
        self.first_job_id = tag * 100_000           # job ids (and so job cgroups) unique per cluster
        self.nodes = [Node(f"n{i}", f"{self.subnet}.{10 + i}", f"tgs{tag}-n{i}", "eth0", f"tgs{tag}n{i}",
                           tuple(str(self.base / "dev" / f"nvidia{g}")
                                 for g in range((i - 1) * self.gpus_per_node, i * self.gpus_per_node)))
                      for i in (1, 2)]
        self.conf = self.base / "etc" / "slurm.conf"
        self.munge_socket = self.base / "munge" / "munge.sock"
        self.mysql_socket = self.base / "mysql.sock"
        # On tmpfs: slurmdbd creates dozens of InnoDB tables per cluster, seconds of fsyncs on disk here.
        self.mysql_dir = Path("/dev/shm") / f"traingate-slurm-{tag}-mysql"
        path = [p for p in os.environ.get("PATH", "").split(":") if p]
        self.env = {"SLURM_CONF": str(self.conf),
                    "PATH": ":".join(dict.fromkeys(path + SBIN_PATH.split(":")))}
        self.users: dict[str, User] = {}
        self.user_python: Path | None = None         # a python the test users can run (see _make_user_python)
        self.preempt_mode = "REQUEUE"
        self._capped: set[str] = set()              # accounts set_grp_gpus capped, for reset()
        self._procs: dict[str, subprocess.Popen] = {}
        self._ports: dict[str, int] = {}
        self._reg_file = REGISTRY / f"cluster-{tag}.json"
        self.timings: dict[str, float] = {}

    # ---------------------------------------------------------------- life cycle
    @classmethod
    def start(cls, base: Path) -> SlurmCluster:
        """Bring a fresh cluster up under `base` (created if missing); stop() undoes everything."""
        if os.geteuid() != 0:
            raise ClusterError("a Slurm test cluster needs root (network namespaces, OS users, cgroups)")
        missing = missing_binaries()
        if missing:
            raise ClusterError(f"{missing[0]} is not installed (make test-deps installs the Slurm packages)")
        t0 = time.monotonic()
        base = Path(base)
        base.mkdir(parents=True, exist_ok=True)
        REGISTRY.mkdir(parents=True, exist_ok=True)
        with open(REGISTRY / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            reap_stale()
            cluster = cls(base, _pick_tag())
            cluster._register()
        try:
            cluster._bring_up()
        except BaseException:
            cluster.stop()
            raise
        cluster.timings["start_s"] = time.monotonic() - t0
        return cluster

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _bring_up(self) -> None:
        t = time.monotonic()
        self._check_traversable(self.base)
        for d in ("etc", "state", "run", "log", "jobtmp", "pyenv"):   # BASE may hold an earlier cluster's
            shutil.rmtree(self.base / d, ignore_errors=True)
        for d in ("etc", "munge", "run", "log", "state/ctld", "dev", "home", "shared", "jobtmp"):
            (self.base / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.base / "jobtmp", 0o1777)
        self.mysql_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.base, 0o711)
        os.chmod(self.base / "shared", 0o1777)
        os.chmod(self.base / "munge", 0o711)   # users reach the socket; the key stays 0400 root
        for p in ("ctld", "dbd"):
            self._ports[p] = _free_port()
        key = self.base / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self._make_gpus()
        self._write_configs()
        self._spawn("munged", ["munged", "-F", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                               f"--pid-file={self.base}/run/munged.pid", f"--seed-file={self.base}/munge/seed",
                               f"--log-file={self.base}/log/munged.log"])
        self._spawn("mariadbd", self._mariadb_argv())
        self._make_network()
        self._make_users()
        self._make_user_python()
        self._wait_unix(self.munge_socket, "munged")
        self._wait_unix(self.mysql_socket, "mariadbd", timeout=60)
        self._make_proc_table()
        self.timings["db_ready_s"] = time.monotonic() - t
        self._spawn("slurmdbd", ["slurmdbd", "-D"], env={"MYSQL_UNIX_PORT": str(self.mysql_socket)})
        self._wait_tcp(self.ctl_addr, self._ports["dbd"], "slurmdbd", timeout=60)
        self.sacctmgr("add", "cluster", self.name)
        self.timings["dbd_ready_s"] = time.monotonic() - t
        self._make_associations()                # before slurmctld, which loads them when it starts
        self._start_controller(clean=True)
        for node in self.nodes:
            self._start_slurmd(node)
        self._wait_nodes_idle(timeout=60)
        self._wait_associations()
        self.timings["ready_s"] = time.monotonic() - t

    def stop(self) -> None:
        """Stop every daemon and job, remove namespaces, bridge, job cgroups and (last one out) users."""
        t = time.monotonic()
        for node in self.nodes:                     # jobs first: their steps outlive slurmd
            self._kill_netns_processes(node.netns)
        for name in [n for n in self._procs if n.startswith("slurmd-")] + ["slurmctld", "slurmdbd",
                                                                           "mariadbd", "munged"]:
            self._stop_proc(name)
        for node in self.nodes:
            self._kill_netns_processes(node.netns)
            _sh("ip", "netns", "delete", node.netns, check=False)
        _sh("ip", "link", "delete", self.bridge, check=False)
        _remove_job_cgroups(self.first_job_id)
        shutil.rmtree(self.mysql_dir, ignore_errors=True)
        with open(REGISTRY / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._reg_file.unlink(missing_ok=True)
            if not _live_registrations():
                _delete_marked_users()
                _remove_slurm_cgroup_roots()
        self.timings["stop_s"] = time.monotonic() - t

    # ---------------------------------------------------------------- public controls
    def sacctmgr(self, *args: str, script: list[str] | None = None) -> str:
        """`sacctmgr -i ARGS`, or the commands of `script` in one session (one process, one connection;
        what one line adds is not visible to the later lines of the same session). Raises ClusterError
        when the output reports a failure: the exit code is 0 then."""
        r = subprocess.run(["sacctmgr", "-i", *args], capture_output=True, text=True, env=self._client_env(),
                           input="\n".join(script) + "\n" if script else None)
        out = (r.stdout + r.stderr).strip()
        if r.returncode != 0 or re.search(r"(?im)^\s*(sacctmgr: )?error|\bunknown\b|\binvalid\b|"
                                          r"\bproblem\b|doesn't exist|not found|nothing new added", out):
            raise ClusterError(f"sacctmgr {' '.join(args) or '; '.join(script or [])}: {out}")
        return out

    def scontrol(self, *args: str) -> str:
        r = subprocess.run(["scontrol", *args], capture_output=True, text=True, env=self._client_env())
        if r.returncode != 0:
            raise ClusterError(f"scontrol {' '.join(args)} exited {r.returncode}: {(r.stdout + r.stderr).strip()}")
        return r.stdout

    def reset(self, timeout: float = 60) -> None:
        """Back to the state start() left: no jobs, every daemon up and nodes idle, no GPU caps, REQUEUE.
        (QOS or association changes made through sacctmgr() directly are the test's to undo.)"""
        if "slurmctld" not in self._procs:
            self.start_controller()
        subprocess.run(["scancel", f"--partition={self.partition}"], capture_output=True, env=self._client_env())
        for node in self.nodes:
            if f"slurmd-{node.name}" not in self._procs:
                self.start_node(node.name)
        for account in list(self._capped):
            self.set_grp_gpus(account, None)
        if self.preempt_mode != "REQUEUE":
            self.set_preempt_mode("REQUEUE")

        def quiet() -> bool:
            r = subprocess.run(["squeue", "-h", "-t", "PD,R,CG,S,CF,RQ,RS,SO", "-o", "%i"], capture_output=True,
                               text=True, env=self._client_env())
            if r.stdout.strip():
                subprocess.run(["scancel", f"--partition={self.partition}"], capture_output=True,
                               env=self._client_env())
                return False
            states = self._node_states()
            for name, state in states.items():
                if state.rstrip("*") in ("drained", "draining", "down"):
                    self.scontrol("update", f"nodename={name}", "state=resume")
            return all(states.get(n.name) == "idle" for n in self.nodes)
        _wait(quiet, timeout, "no jobs and both nodes idle", interval=0.3)

    def set_preempt_mode(self, mode: str) -> None:
        """PreemptMode REQUEUE or CANCEL: rewrite slurm.conf, `scontrol reconfigure`, check it took."""
        if mode not in ("REQUEUE", "CANCEL"):
            raise ValueError(f"preempt mode {mode!r} is not REQUEUE or CANCEL")
        text = re.sub(r"(?m)^PreemptMode=.*$", f"PreemptMode={mode}", self.conf.read_text())
        self.conf.write_text(text)
        self.scontrol("reconfigure")
        _wait(lambda: self._config_value("PreemptMode") == mode, 30, f"PreemptMode={mode} in scontrol show config")
        self.preempt_mode = mode

    def stop_controller(self, hard: bool = False) -> None:
        """Stop slurmctld: SIGTERM (it saves its state), or SIGKILL when `hard`. Jobs keep running on the nodes."""
        self._stop_proc("slurmctld", sig=signal.SIGKILL if hard else signal.SIGTERM)

    def start_controller(self) -> None:
        """Start slurmctld on its saved state and wait until it answers, knows both nodes and has each user's
        association with its uid (it resolves them again as it starts)."""
        self._start_controller(clean=False)
        self._wait_nodes_idle(timeout=60, any_state=True)
        self._wait_associations()

    def restart_controller(self, hard: bool = False) -> None:
        """stop_controller(hard) then start_controller()."""
        self.stop_controller(hard)
        self.start_controller()

    def kill_node(self, name: str, jobs: bool = False) -> None:
        """SIGKILL the node's slurmd (and, with `jobs`, every process in its namespace: a lost machine)."""
        node = self.node(name)
        self._stop_proc(f"slurmd-{node.name}", sig=signal.SIGKILL)
        if jobs:
            self._kill_netns_processes(node.netns)

    def start_node(self, name: str) -> None:
        """Start the node's slurmd again and wait until it has registered with the controller."""
        node = self.node(name)
        before = self._slurmd_start_time(node.name)
        time.sleep(max(0.0, before + 1.1 - time.time()))   # the registered start time counts whole seconds
        self._start_slurmd(node)
        _wait(lambda: self._slurmd_start_time(node.name) > before
              and "*" not in self._node_states().get(node.name, "*"), 60, f"{node.name}'s slurmd to register")

    def _slurmd_start_time(self, name: str) -> int:
        r = subprocess.run(["sinfo", "--json"], capture_output=True, text=True, env=self._client_env())
        return next((n["slurmd_start_time"] for n in json.loads(r.stdout or "{}").get("nodes", [])
                     if n["name"] == name), 0)

    def set_grp_gpus(self, account: str, n: int | None) -> None:
        """Cap the GPUs all running jobs of `account` may hold together (None: no cap); waits until slurmctld has it."""
        value = "-1" if n is None else str(int(n))
        self.sacctmgr("modify", "account", "where", f"name={account}", f"cluster={self.name}",
                      "set", f"GrpTRES=gres/gpu={value}")
        want = f"gres/gpu={'N' if n is None else n}("

        def seen() -> bool:
            out = self.scontrol("show", "assoc_mgr", f"accounts={account}", "flags=assoc")
            m = re.search(r"Account=" + re.escape(account) + r" UserName= .*?\n\s*GrpTRES=(\S+)", out, re.S)
            return bool(m) and want in m.group(1)
        _wait(seen, 30, f"GrpTRES gres/gpu={value} on account {account} in slurmctld")
        if n is None:
            self._capped.discard(account)
        else:
            self._capped.add(account)

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise ValueError(f"node {name!r} is not one of {[n.name for n in self.nodes]}")

    def shared_dir(self, name: str) -> Path:
        """A directory every test user may read and write (sticky, mode 1777) under BASE/shared."""
        d = self.base / "shared" / name
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o1777)
        return d

    def rss_mib(self) -> dict[str, float]:
        """Resident memory of each daemon, MiB."""
        out = {}
        for name, proc in self._procs.items():
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
            except FileNotFoundError:
                continue
            m = re.search(r"VmRSS:\s+(\d+) kB", status)
            if m:
                out[name] = int(m.group(1)) / 1024
        return out

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self._procs.items() if _alive(p.pid)}

    # ---------------------------------------------------------------- pieces
    def _client_env(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def _check_traversable(self, path: Path) -> None:
        for p in [path, *path.parents][1:]:
            if not os.stat(p).st_mode & 0o001:
                raise ClusterError(f"{p} is not searchable by other users (mode "
                                   f"{oct(os.stat(p).st_mode & 0o777)}); the test users could not reach "
                                   f"{path}: put the cluster under a directory from tempfile.mkdtemp()")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.base / "log" / f"{name}.out", "ab")
        full_env = {**self._client_env(), **(env or {})}
        self._procs[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                             env=full_env, start_new_session=True, cwd=self.base)
        log.close()
        self._register()

    def _stop_proc(self, name: str, sig: int = signal.SIGTERM, timeout: float = 15) -> None:
        proc = self._procs.pop(name, None)
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self._register()

    def _check_running(self, name: str) -> None:
        proc = self._procs.get(name)
        if proc is not None and proc.poll() is not None:
            raise ClusterError(f"{name} exited {proc.returncode}:\n{self._log_tail(name)}")

    def _log_tail(self, name: str, lines: int = 15) -> str:
        texts = []
        for p in sorted((self.base / "log").glob(f"{name.split('-')[0]}*")):
            texts.append(f"--- {p}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(texts)

    def _wait_unix(self, path: Path, name: str, timeout: float = 30) -> None:
        def up() -> bool:
            self._check_running(name)
            with socket.socket(socket.AF_UNIX) as s:
                try:
                    s.connect(str(path))
                    return True
                except OSError:
                    return False
        _wait(up, timeout, f"{name} on {path}")

    def _wait_tcp(self, host: str, port: int, name: str, timeout: float = 30) -> None:
        def up() -> bool:
            self._check_running(name)
            with socket.socket() as s:
                s.settimeout(1)
                return s.connect_ex((host, port)) == 0
        _wait(up, timeout, f"{name} on {host}:{port}")

    def _mariadb_argv(self) -> list[str]:
        d = self.mysql_dir
        # No grant tables and no TCP: the only way in is the Unix socket in root's 0711 BASE.
        return ["mariadbd", "--no-defaults", "--user=root", f"--datadir={d}", f"--socket={self.mysql_socket}",
                "--skip-networking", "--skip-grant-tables", "--skip-name-resolve", "--skip-log-bin",
                f"--pid-file={self.base}/run/mariadbd.pid", f"--log-error={self.base}/log/mariadbd.log",
                "--performance-schema=off", "--innodb-buffer-pool-size=8M", "--innodb-log-file-size=4M",
                "--innodb-log-buffer-size=1M", "--innodb-data-file-path=ibdata1:4M:autoextend",
                "--innodb-temp-data-file-path=ibtmp1:4M:autoextend", "--innodb-doublewrite=0",
                "--innodb-flush-log-at-trx-commit=0", "--key-buffer-size=1M", "--aria-pagecache-buffer-size=1M",
                "--query-cache-size=0", "--max-connections=30", "--table-open-cache=200"]

    def _make_proc_table(self) -> None:
        # slurmdbd keeps stored procedures, which live in mysql.proc; the datadir is created by the
        # server itself (mariadb-install-db costs ~7 s here), so only that one system table is made.
        ddl = next(line for line in Path(MYSQL_SYSTEM_TABLES).read_text().splitlines()
                   if line.startswith("CREATE TABLE IF NOT EXISTS proc "))
        _sh("mariadb", "--no-defaults", f"--socket={self.mysql_socket}", "-uroot",
            "-e", f"CREATE DATABASE IF NOT EXISTS mysql; USE mysql; {ddl}")

    def _make_gpus(self) -> None:
        for node in self.nodes:
            for dev in node.gpu_devices:
                if not os.path.exists(dev):
                    os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(GPU_MAJOR, int(dev.rsplit("nvidia", 1)[1])))
                    os.chmod(dev, 0o666)          # as /dev/nvidia* are; mknod's mode went through the umask

    def _gpu_files(self, index: int) -> str:
        lo = index * self.gpus_per_node
        return f"{self.base}/dev/nvidia[{lo}-{lo + self.gpus_per_node - 1}]"

    def _write_configs(self) -> None:
        b = self.base
        etc = b / "etc"
        nodes = "\n".join(f"NodeName={n.name} NodeAddr={n.addr} CPUs={self.cpus_per_node} RealMemory=4096 "
                          f"Gres=gpu:{self.gres_type}:{self.gpus_per_node} State=UNKNOWN" for n in self.nodes)
        (etc / "slurm.conf").write_text(f"""\
ClusterName={self.name}
SlurmctldHost={self.hostname}({self.ctl_addr})
SlurmctldPort={self._ports['ctld']}
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket},cred_expire=10
CredType=cred/munge
StateSaveLocation={b}/state/ctld
SlurmdSpoolDir={b}/state/%n
SlurmctldPidFile={b}/run/slurmctld.pid
SlurmdPidFile={b}/run/slurmd-%n.pid
SlurmctldLogFile={b}/log/slurmctld.log
SlurmdLogFile={b}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmdParameters=config_overrides
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
MailProg=/bin/true
FirstJobId={self.first_job_id}
ReturnToService=2
SlurmdTimeout=10
MessageTimeout=10
KillWait=5
InactiveLimit=0
EnforcePartLimits=ALL
MinJobAge=300
JobRequeue=1
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=2,sched_min_interval=200000
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
GresTypes=gpu
PriorityType=priority/multifactor
PriorityWeightQOS=100000
PriorityWeightFairshare=10000
PriorityWeightAge=100
PriorityDecayHalfLife=01:00:00
PriorityCalcPeriod=1
PreemptType=preempt/qos
PreemptMode={self.preempt_mode}
SlurmctldParameters=preempt_send_user_signal
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost={self.ctl_addr}
AccountingStoragePort={self._ports['dbd']}
AccountingStoragePass={self.munge_socket}
AccountingStorageTRES=gres/gpu,gres/gpu:{self.gres_type}
AccountingStorageEnforce=associations,limits,qos
JobCompType=jobcomp/none
TaskProlog={etc}/task_prolog.sh
Epilog={etc}/epilog.sh
{nodes}
PartitionName={self.partition} Nodes={','.join(n.name for n in self.nodes)} Default=YES MaxTime={self.max_time} State=UP
""")
        # Every task gets TMPDIR=BASE/jobtmp/JOBID, removed when the job ends on a node: what jobs
        # write to "/tmp" (torchrun's torchelastic_* directories) goes away with the job and the cluster.
        jobtmp = b / "jobtmp"
        (etc / "task_prolog.sh").write_text(f'#!/bin/sh\nmkdir -p "{jobtmp}/$SLURM_JOB_ID"\n'
                                            f'echo "export TMPDIR={jobtmp}/$SLURM_JOB_ID"\n')
        (etc / "epilog.sh").write_text(f'#!/bin/sh\nrm -rf "{jobtmp}/$SLURM_JOB_ID"\n')
        for script in ("task_prolog.sh", "epilog.sh"):
            os.chmod(etc / script, 0o755)
        gres = ["AutoDetect=off"] + [f"NodeName={n.name} Name=gpu Type={self.gres_type} File={self._gpu_files(i)}"
                                     for i, n in enumerate(self.nodes)]
        (etc / "gres.conf").write_text("\n".join(gres) + "\n")
        (etc / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n"
                                         "ConstrainDevices=yes\nConstrainCores=no\nConstrainRAMSpace=no\n")
        dbd = etc / "slurmdbd.conf"
        dbd.write_text(f"""\
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
DbdHost={self.hostname}
DbdAddr={self.ctl_addr}
DbdPort={self._ports['dbd']}
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
PidFile={b}/run/slurmdbd.pid
LogFile={b}/log/slurmdbd.log
DebugLevel=info
""")
        os.chmod(dbd, 0o600)

    def _make_network(self) -> None:
        ip = lambda *a: _sh("ip", *a)  # noqa: E731
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.ctl_addr}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for node in self.nodes:
            ip("netns", "add", node.netns)
            ip("link", "add", node.host_ifname, "type", "veth", "peer", "name", f"{node.host_ifname}p")
            ip("link", "set", f"{node.host_ifname}p", "netns", node.netns)
            ip("link", "set", node.host_ifname, "master", self.bridge)
            ip("link", "set", node.host_ifname, "up")
            ip("-n", node.netns, "link", "set", f"{node.host_ifname}p", "name", node.ifname)
            ip("-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", node.ifname)
            ip("-n", node.netns, "link", "set", node.ifname, "up")
            ip("-n", node.netns, "link", "set", "lo", "up")

    def _make_users(self) -> None:
        import pwd
        for name, (account, qos) in self.user_specs.items():
            # Under the registry's lock: two clusters starting at once (two suites, or two xdist workers) would
            # otherwise both find a user missing and the second useradd fail on the first one's user or lock.
            with open(REGISTRY / "lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    pw = pwd.getpwnam(name)
                except KeyError:
                    _sh("useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
                        "--shell", "/bin/bash", "--comment", USER_MARK, name)
                    pw = pwd.getpwnam(name)
            home = self.base / "home" / name
            home.mkdir(exist_ok=True)
            os.chown(home, pw.pw_uid, pw.pw_gid)
            os.chmod(home, 0o700)
            env = {**self._client_env(), "HOME": str(home), "USER": name, "LOGNAME": name}
            self.users[name] = User(name, pw.pw_uid, pw.pw_gid, account, qos, home, env)

    def _make_user_python(self) -> None:
        # This interpreter may live where other users cannot enter (pyenv under /root): the test
        # users get a hand-made venv on the system's python of the same minor version whose one
        # .pth adds this interpreter's site-packages as a site dir (its own .pth files, editable
        # installs included, apply). `python` and `torchrun` are first on the users' PATH.
        system_python = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
        if not system_python.exists():
            return
        venv = self.base / "pyenv"
        site_dir = venv / "lib" / system_python.name / "site-packages"
        site_dir.mkdir(parents=True, exist_ok=True)
        (venv / "bin").mkdir(exist_ok=True)
        (venv / "pyvenv.cfg").write_text(f"home = {system_python.parent}\ninclude-system-site-packages = false\n")
        for name in ("python", "python3"):
            (venv / "bin" / name).symlink_to(system_python)
        project_site = sysconfig.get_paths()["purelib"]
        (site_dir / "traingate-tests.pth").write_text(f"import site; site.addsitedir({project_site!r})\n")
        torchrun = venv / "bin" / "torchrun"
        torchrun.write_text(f"#!{venv}/bin/python\nimport sys\nfrom torch.distributed.run import main\n"
                            "sys.exit(main())\n")
        os.chmod(torchrun, 0o755)
        self.user_python = venv / "bin" / "python"
        for user in self.users.values():
            user.env["PATH"] = f"{venv / 'bin'}:{user.env['PATH']}"

    def _make_associations(self) -> None:
        # Three sessions, each seeing what the one before it added (a sacctmgr call costs ~0.6 s here).
        qos_all = ",".join(self.qos_names)
        self.sacctmgr(script=["add qos research Priority=10", "add qos production Priority=100",
                              "add qos urgent Priority=1000"])
        self.sacctmgr(script=["modify qos where name=urgent set Preempt=research,production",
                              f"add account {','.join(self.accounts)} cluster={self.name} parent=root fairshare=1 "
                              f"qos={qos_all} defaultqos={self.default_qos}"])
        self.sacctmgr(script=[f"add user root account={','.join(self.accounts)} cluster={self.name} "
                              f"qos={qos_all} defaultqos={self.default_qos}"]
                      + [f"add user {u.name} account={u.account} cluster={self.name} defaultaccount={u.account} "
                         f"qos={','.join(u.qos)} defaultqos={self.default_qos}" for u in self.users.values()])

    def _wait_associations(self) -> None:
        """Until slurmctld's association cache holds every QOS and each user's association with the uid the
        tests submit as. slurmctld matches a job to an association by uid; a user it could not resolve when
        it loaded the association (the OS user absent at that moment: users are shared by every test cluster
        on the machine) keeps uid NO_VAL, and every job of that user is refused with "Invalid account or
        account/partition combination specified". `scontrol reconfigure` makes slurmctld resolve such uids."""
        unresolved = [0.0]

        def seen() -> bool:
            out = self.scontrol("show", "assoc_mgr", "flags=assoc,qos")
            if any(f"UserName={u}({NO_VAL})" in out for u in self.users) and time.monotonic() > unresolved[0]:
                self.scontrol("reconfigure")
                unresolved[0] = time.monotonic() + 5
            return (all(f"QOS={q}(" in out for q in self.qos_names)
                    and all(f"Account={u.account} UserName={u.name}({u.uid})" in out for u in self.users.values()))
        _wait(seen, 60, "accounts, users (with their uids) and QOS in slurmctld's association cache", interval=0.2)

    def _start_controller(self, clean: bool) -> None:
        self._spawn("slurmctld", ["slurmctld", "-D", "-i"] + (["-c"] if clean else []))
        _wait(lambda: self._check_running("slurmctld") or self._ping(), 60, "slurmctld to answer",
              interval=0.2)

    def _ping(self) -> bool:
        r = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, env=self._client_env())
        return "is UP" in r.stdout

    def _start_slurmd(self, node: Node) -> None:
        (self.base / "state" / node.name).mkdir(parents=True, exist_ok=True)
        # nsenter, not `ip netns exec`: the latter remounts /sys, hiding the cgroup hierarchy from slurmd.
        self._spawn(f"slurmd-{node.name}", ["nsenter", f"--net=/run/netns/{node.netns}", "--",
                                            "slurmd", "-D", "-N", node.name])

    def _node_states(self) -> dict[str, str]:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True,
                           env=self._client_env())
        return dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)

    def _wait_nodes_idle(self, timeout: float, any_state: bool = False) -> None:
        def ready() -> bool:
            for node in self.nodes:
                self._check_running(f"slurmd-{node.name}")
            states = self._node_states()
            if any_state:
                return all(n.name in states for n in self.nodes)
            return all(states.get(n.name) == "idle" for n in self.nodes)
        _wait(ready, timeout, "both nodes idle", interval=0.2)

    def _config_value(self, key: str) -> str | None:
        m = re.search(rf"(?m)^{key}\s*=\s*(\S+)", self.scontrol("show", "config"))
        return m.group(1) if m else None

    def _kill_netns_processes(self, netns: str) -> None:
        for _ in range(50):
            r = _sh("ip", "netns", "pids", netns, check=False)
            pids = [int(p) for p in r.stdout.split() if _alive(int(p))]
            if r.returncode != 0 or not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for name, proc in list(self._procs.items()):
                if proc.pid in pids:
                    proc.wait(10)
                    self._procs.pop(name)
            time.sleep(0.1)

    def _register(self) -> None:
        data = {"owner": os.getpid(), "base": str(self.base), "tag": self.tag, "bridge": self.bridge,
                "mysql_dir": str(self.mysql_dir),
                "netns": [n.netns for n in self.nodes], "first_job_id": self.first_job_id,
                "pids": {n: p.pid for n, p in self._procs.items()}}
        tmp = self._reg_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self._reg_file)


# -------------------------------------------------------------------- machine-wide bookkeeping
def _registrations() -> Iterator[tuple[Path, dict]]:
    for f in sorted(REGISTRY.glob("cluster-*.json")):
        try:
            yield f, json.loads(f.read_text())
        except (OSError, ValueError):
            continue


def _live_registrations() -> list[dict]:
    return [d for _, d in _registrations() if _alive(d["owner"])]


def _pick_tag() -> int:
    used = {d["tag"] for _, d in _registrations()}
    links = _sh("ip", "-o", "link", "show", check=False).stdout
    routes = _sh("ip", "-4", "route", "show", check=False).stdout
    candidates = [t for t in range(20, 250) if t not in used and f"tgsb{t}:" not in links
                  and f"10.88.{t}." not in routes]
    if not candidates:
        raise ClusterError("no free 10.88.X.0/24 subnet for a Slurm test cluster")
    return random.Random(os.getpid()).choice(candidates)


def reap_stale() -> list[str]:
    """Tear down what clusters whose owning process died left behind; returns their bases."""
    reaped = []
    for f, d in _registrations():
        if _alive(d["owner"]):
            continue
        for pid in d.get("pids", {}).values():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except FileNotFoundError:
                continue
            if _alive(pid) and any(w in cmdline for w in (b"slurm", b"munged", b"mariadbd", b"nsenter")):
                os.kill(pid, signal.SIGKILL)
        for ns in d.get("netns", []):
            r = _sh("ip", "netns", "pids", ns, check=False)
            for p in r.stdout.split():
                try:
                    os.kill(int(p), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _sh("ip", "netns", "delete", ns, check=False)
        _sh("ip", "link", "delete", d.get("bridge", ""), check=False)
        _remove_job_cgroups(d.get("first_job_id", 0))
        if d.get("mysql_dir"):
            shutil.rmtree(d["mysql_dir"], ignore_errors=True)
        f.unlink(missing_ok=True)
        reaped.append(d["base"])
    if reaped and not _live_registrations():
        _delete_marked_users()
        _remove_slurm_cgroup_roots()
    return reaped


def _cgroup_slurm_roots() -> list[Path]:
    return [p for p in Path("/sys/fs/cgroup").glob("*/slurm*") if p.is_dir()]


def _rmdir_tree(d: Path) -> None:
    """rmdir a cgroup directory bottom-up (cgroup files cannot be unlinked; empty groups can be rmdir'd)."""
    for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        try:
            sub.rmdir()
        except OSError:
            pass
    try:
        d.rmdir()
    except OSError:
        pass


def _remove_job_cgroups(first_job_id: int) -> None:
    if not first_job_id:
        return
    for root in _cgroup_slurm_roots():
        for job in root.glob("uid_*/job_*"):
            try:
                job_id = int(job.name.split("_", 1)[1])
            except ValueError:
                continue
            if first_job_id <= job_id < first_job_id + 100_000:
                _rmdir_tree(job)


def _remove_slurm_cgroup_roots() -> None:
    for root in _cgroup_slurm_roots():
        _rmdir_tree(root)


def _delete_marked_users() -> None:
    import pwd
    for pw in pwd.getpwall():
        if pw.pw_gecos == USER_MARK:
            _sh("userdel", pw.pw_name, check=False)


# -------------------------------------------------------------------- developer entry
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A real Slurm test cluster on this machine.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a cluster under DIR and keep it up until Ctrl-C")
    up.add_argument("dir", type=Path)
    sub.add_parser("reap", help="tear down what crashed clusters left behind")
    args = parser.parse_args(argv)
    if args.cmd == "reap":
        with open(REGISTRY / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            print("\n".join(reap_stale()) or "nothing to reap")
        return 0
    try:
        cluster = SlurmCluster.start(args.dir)
    except ClusterError as e:
        print(f"slurm cluster: {e}", file=sys.stderr)
        return 1
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.append(1))
    print(f"# Slurm cluster {cluster.name} up in {cluster.timings['start_s']:.1f} s under {cluster.base}")
    for k, v in cluster.env.items():
        print(f"export {k}={v}")
    print(f"# nodes: {', '.join(f'{n.name}={n.addr} (netns {n.netns})' for n in cluster.nodes)}")
    users = ", ".join(f"{u.name} (account {u.account}, qos {'+'.join(u.qos)})" for u in cluster.users.values())
    print(f"# users: {users}; root: accounts {', '.join(cluster.accounts)}, every QOS")
    print(f"# shared dir: {cluster.shared_dir('dev')}; logs: {cluster.base / 'log'}")
    print("# Ctrl-C tears it down", flush=True)
    try:
        while not stop:
            time.sleep(0.5)
    finally:
        cluster.stop()
        print(f"# stopped in {cluster.timings['stop_s']:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
