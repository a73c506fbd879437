"""Warm restarts: training processes forked from a pre-imported "zygote" instead of started cold.

A cold training process spends ~3 s importing torch, TorchDynamo and traingate before it can
rejoin its group; after a lost worker that is most of the time to recovery. With
``supervision.warm_restarts`` one zygote (:class:`Zygote`) imports all of that once and forks a ready worker
per request: the ladder starts one per run, which every stage of the run on this host borrows, and a stage
supervised alone starts its own. Once a launch's workers are forked it also
loads their recipe's data (:func:`traingate.runtime.train.preload_data`): the workers of an in-place restart
find it in memory. What torchrun launches is the thin
entry ``python -m traingate.runtime.warm SOCKET --job JOB`` (this module's top level imports only
the standard library's cheapest modules): it hands the zygote its argv, environment, cwd and
stdin/stdout/stderr (SCM_RIGHTS); the forked child becomes the worker (its own session, the entry's
fds and environment) and runs :func:`traingate.runtime.train.main`. The entry relays SIGTERM and
SIGINT to it and ends as it ended, a death by a signal re-raised as the same signal, so torchrun and
the supervisor classify the thin entry exactly as they would the worker. The child reports its own
pid (heartbeats, the fault injector and a hang kill all reach the real worker) and exit code; the
zygote reports deaths by a signal. A child whose thin entry is gone (torchrun SIGKILLed it) kills
itself. Without a zygote (not started yet, dead, refusing) the entry runs ``train.main`` itself.

The request (:mod:`traingate.runtime.handoff`'s wire format) is ``{argv, env, cwd, agent}``.
"""

from __future__ import annotations

import gc
import importlib
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from traingate.runtime import handoff

_wake: list[int] = []  # the zygote's self-pipe: SIGCHLD wakes its loop (read end, write end)
_jobs: dict[str, bool] = {}  # the zygote's: job files of the workers it forked -> their data preloaded (or tried)
_refusing: list[str] = []  # the zygote's: why it forks no more workers, if it does not


# ---------------------------------------------------------------- thin entry (runs under torchrun)

# What a zygote imports before it forks: torch, TorchDynamo (DDP's and the optimizer's constructors import
# it: about 2.4 CPU-s of 4.5 here) and the training entry point.
PRELOADED = ("torch", "torch._dynamo", "traingate.runtime.train")


def main(argv: list[str] | None = None) -> int:
    """``python -m traingate.runtime.warm SOCKET [train args]``: run one worker, warm if a zygote answers."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) in (2, 3) and argv[0] == "--serve":
        return serve(argv[1], int(argv[2]) if len(argv) == 3 and argv[2].isdigit() else None)
    if len(argv) > 2 and argv[0] == "--ahead":
        return ahead(argv[1], argv[2:])
    if not argv or argv[0].startswith("-"):
        print(
            "python -m traingate.runtime.warm: usage: SOCKET [--job PATH] "
            "(or --serve SOCKET [SUPERVISOR_PID], --ahead LOG COMMAND...)",
            file=sys.stderr,
        )
        return 64
    path, train_argv = argv[0], argv[1:]
    request = {"argv": train_argv, "env": dict(os.environ), "cwd": os.getcwd(), "agent": os.getppid()}
    return handoff.ask(path, request, lambda: _cold(train_argv))


def _cold(train_argv: list[str]) -> int:
    # lazy: the thin entry imports the training stack (torch: seconds) only when no zygote serves it
    from traingate.runtime import train

    return train.main(train_argv)


# ---------------------------------------------------------------- zygote (started by the supervisor)


def serve(path: str, supervisor: int | None = None) -> int:
    """Bind ``path``, import the training stack once, then fork a worker per request until SIGTERM or
    until ``supervisor`` (the process that started it; default: its parent now) is no longer its parent.

    The socket is bound before the imports, so entries that arrive meanwhile wait in the backlog
    instead of starting cold beside the importing zygote. Forking needs a single-threaded parent
    (a thread pool's locks would be copied held): a zygote that finds other threads refuses to serve,
    and its waiting entries fall back to the cold path.

    SIGTERM is taken synchronously (``sigtimedwait``) to see who sent it: the zygote is its workers'
    parent, so a worker preempting "its parent and siblings" (the ``term`` fault of drills, as a
    scheduler would) reaches the zygote instead of torchrun's agent; that one is passed on to the
    agent. A SIGTERM from anyone else ends the zygote.
    """
    # A supervisor killed between starting this process and this line left it to another parent already: the
    # zygote's parent check would then hold for that parent and it would serve nobody, forever.
    supervisor = os.getppid() if supervisor is None else supervisor
    if os.getppid() != supervisor:
        print(f"zygote: its supervisor (pid {supervisor}) ended before it started; not serving", file=sys.stderr)
        return 0
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    # A worker's death must reach its entry at once: torchrun classifies a group by the first failure
    # it sees, and a peer's "connection reset" must not beat the killed rank's -9 to it.
    _wake.extend(os.pipe())
    for fd in _wake:
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(_wake[1])
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    importing = time.time()
    # The imports make hundreds of thousands of objects and no garbage: collections during them cost 0.6 of
    # 3.8 CPU-s (measured here). Frozen afterwards, those objects stay out of every later collection, in the
    # zygote and in its forked workers, whose copies of their pages are then never written by the collector.
    gc.disable()
    for name in PRELOADED:  # what the zygote is for: imported once, before any fork
        importlib.import_module(name)
    # The built-in recipes' modules, which the registry imports at a worker's first get_recipe (their param
    # models' schemas are built then): 7-8 ms of every forked worker's start on an idle 2-core box.
    importlib.import_module("traingate.recipes").recipe_names()
    gc.freeze()
    gc.enable()
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads != 1:
        print(
            f"zygote: {threads} threads after the imports (a BLAS/OpenMP pool? OMP_NUM_THREADS="
            f"{os.environ.get('OMP_NUM_THREADS')}); forking would copy their locks; not serving, "
            "workers start cold",
            file=sys.stderr,
            flush=True,
        )
        return 3
    # When, to the hundredth of an epoch second: a stage's start is told apart from these marks (bench slurm).
    print(
        f"zygote: ready on {path} (pid {os.getpid()}) at {time.time():.2f}, imports {time.time() - importing:.2f} s, "
        f"{time.process_time():.2f} CPU-s since its start",
        file=sys.stderr,
        flush=True,
    )
    children: dict[int, tuple[socket.socket, int | None]] = {}  # pid -> (its entry's connection, its agent)
    stopping = False
    while not stopping and os.getppid() == supervisor:
        ready, _, _ = select.select([listener.fileno(), _wake[0]], [], [], 0.1)
        if _wake[0] in ready:
            while True:
                try:
                    if not os.read(_wake[0], 512):
                        break
                except BlockingIOError:
                    break
        if not ready and (pending := [job for job, done in _jobs.items() if not done]):
            _preload(pending[0])  # nothing asked for 0.1 s: the launch's workers are all forked
        if listener.fileno() in ready:
            conn, _ = listener.accept()
            child = _fork_worker(conn, listener, children)
            if child is None:
                conn.close()
            else:
                children[child[0]] = (conn, child[1])
        while (info := signal.sigtimedwait([signal.SIGTERM], 0)) is not None:
            agent = children[info.si_pid][1] if info.si_pid in children else None
            if info.si_pid not in children:
                stopping = True
            elif agent is not None:
                with _suppress_gone():
                    os.kill(agent, signal.SIGTERM)
        _reap(children, block=False)
    if stopping:
        # The stage is over: whatever is left was abandoned by its entry; do not leave it behind.
        # (On the supervisor's death the workers stay: they checkpoint and exit on their own.)
        for child_pid in children:
            with _suppress_gone():
                os.kill(child_pid, signal.SIGKILL)
        while children:
            _reap(children, block=True)
    listener.close()
    return 0


def _fork_worker(
    conn: socket.socket, listener: socket.socket, children: dict[int, tuple[socket.socket, int | None]]
) -> tuple[int, int | None] | None:
    """Fork a worker for the request on ``conn``: (its pid, its torchrun agent or None), None for a bad request
    or when the zygote no longer forks (its entry then starts the worker cold)."""
    if _refusing:
        print(f"zygote: not forking, the worker starts cold: {_refusing[0]}", file=sys.stderr, flush=True)
        return None
    conn.settimeout(10.0)
    try:
        request, fds = handoff.read_request(conn)
    except (OSError, ValueError) as e:
        print(f"zygote: bad request: {e}", file=sys.stderr, flush=True)
        return None
    conn.settimeout(None)
    pid = os.fork()
    if pid == 0:
        try:
            _become_worker(conn, listener, children, request, fds)  # ends in os._exit
        finally:
            os._exit(70)  # an exception escaped the worker's own handling (EX_SOFTWARE)
    for fd in fds:
        os.close(fd)
    argv = request["argv"]
    job = argv[argv.index("--job") + 1] if "--job" in argv[:-1] else None
    if job is not None:
        _jobs.setdefault(job, False)
    env = request["env"]
    print(
        f"zygote: forked worker {pid} (rank {env.get('RANK', '0')}, torchrun restart "
        f"{env.get('TORCHELASTIC_RESTART_COUNT', '-')})" + (f" for {job}" if job is not None else ""),
        file=sys.stderr,
        flush=True,
    )
    return pid, (int(request["agent"]) if "TORCHELASTIC_RUN_ID" in env else None)


def _preload(job: str) -> None:
    """Load the recipe data of ``job`` here, so that every worker forked from now on finds it in memory."""
    _jobs[job] = True
    started = time.time()
    train = sys.modules["traingate.runtime.train"]  # imported by the zygote (PRELOADED)
    try:
        key = train.preload_data(job)
    except Exception as e:  # noqa: BLE001 - a worker loads the data itself and reports what fails there
        print(f"zygote: data of {job} not preloaded: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return
    gc.freeze()  # the data's objects stay out of every later collection, here and in the forked workers
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads != 1:
        _refusing.append(f"{threads} threads after loading the data of {job}; forking would copy their locks")
        print(f"zygote: {_refusing[0]}; not forking any more", file=sys.stderr, flush=True)
        return
    print(
        f"zygote: preloaded the data of {job} (spec {key}) in {time.time() - started:.2f} s",
        file=sys.stderr,
        flush=True,
    )


def _become_worker(
    conn: socket.socket,
    listener: socket.socket,
    children: dict[int, tuple[socket.socket, int | None]],
    request: dict,
    fds: list[int],
) -> None:
    """In the forked child: take the entry's place (session, fds, environment, cwd) and train."""
    listener.close()
    for other, _ in children.values():
        other.close()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])  # the zygote blocks it; a worker must not
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    for fd in _wake:
        os.close(fd)
    # Like a worker torchrun starts: its own session. An entry SIGKILLed by torchrun after its grace, or with
    # the tree by the supervisor, takes the worker with it: a worker nobody waits for must not train on.
    done = handoff.take_place(conn, request, fds, "warm-entry-watch")
    sys.argv = [sys.argv[0], *request["argv"]]
    torch = sys.modules["torch"]  # imported by the zygote (PRELOADED)
    # The zygote imported torch under its own environment; the worker's thread count is the entry's.
    if (threads := os.environ.get("OMP_NUM_THREADS", "")).isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    # train._stop_agent SIGTERMs its parent to stop torchrun's agent; this process's parent is the
    # zygote, the agent is the entry's parent.
    agent = int(request["agent"])
    os.getppid = lambda: agent  # type: ignore[assignment]
    train = sys.modules["traingate.runtime.train"]  # imported by the zygote (PRELOADED)
    try:
        code = train.main(request["argv"])
    except SystemExit as e:
        code = handoff.exit_code(e)
    handoff.finish(conn, done, code)


def _reap(children: dict[int, tuple[socket.socket, int | None]], block: bool) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        if pid not in children:
            continue
        conn, _ = children.pop(pid)
        # A worker that exited has said so itself; a signal it could not report.
        if os.WIFSIGNALED(status):
            try:
                conn.sendall(handoff.REC.pack(b"S", os.WTERMSIG(status)))
            except OSError:
                pass  # its entry is gone too
        conn.close()
        if block:
            return


class _suppress_gone:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, value, tb) -> bool:
        return kind is ProcessLookupError


# ---------------------------------------------------------------- a zygote started ahead of its supervisor


def ahead(log_path: str, command: list[str]) -> int:
    """``python -m traingate.runtime.warm --ahead LOG COMMAND...``: start a zygote, then become
    ``COMMAND --zygote HANDLE`` (exec: same pid, so a signal meant for the command reaches it).

    A Slurm batch step of a warm stage starts this way: the zygote's imports (torch, TorchDynamo, the trainer:
    4-5 CPU-s) run beside the batch step's own imports and set-up instead of after them. The zygote stays
    this pid's child through the exec, so it still ends with its supervisor; the command takes it over with
    :meth:`Zygote.adopt`.
    """
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"  # the workers' sys.stdout is the zygote's, made as it starts
    # A zygote must be single-threaded when it forks; torch's OpenMP pool starts at import when the count is
    # unset (a stage's environment sets the same default; a user's own value is kept).
    env.setdefault("OMP_NUM_THREADS", "1")
    zygote = Zygote(sys.executable, env, log_path)
    os.execvp(command[0], [*command, "--zygote", zygote.handle])
    return 70  # not reached: execvp returns only by raising


class _Inherited:
    """A child this process holds through an exec: the part of ``subprocess.Popen`` that :class:`Zygote` uses."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -signal.SIGKILL  # reaped elsewhere: gone, how is unknown
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with _suppress_gone():
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# ---------------------------------------------------------------- the supervisor's handle


class Zygote:
    """One stage's zygote process, started by the supervisor, stopped with the stage; or one run's, ``shared`` by
    its stages on this host (started by the ladder's flow, stopped when the flow ends; a stage only releases it).

    The socket lives in a private temporary directory (mode 0700: only this user may ask for a fork;
    a stage directory's path may be too long for a unix socket's 107 bytes).
    """

    shared = False

    def __init__(self, python: str, env: dict[str, str], log_path: str, shared: bool = False):
        self.shared = shared
        self.log_path = log_path
        self.dir = tempfile.mkdtemp(prefix="traingate-zygote-")
        self.socket = os.path.join(self.dir, "sock")
        with open(log_path, "ab") as log:
            self.popen = subprocess.Popen(
                [python, "-m", "traingate.runtime.warm", "--serve", self.socket, str(os.getpid())],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @classmethod
    def adopt(cls, handle: str, log_path: str) -> Zygote:
        """The zygote :func:`ahead` started before it exec'd into this process (``handle``: its ``--zygote``)."""
        pid, _, directory = handle.partition(":")
        if not pid.isdigit() or not directory:
            raise ValueError(
                f"--zygote {handle!r}: expected PID:DIRECTORY, as python -m traingate.runtime.warm --ahead gives it"
            )
        zygote = cls.__new__(cls)
        zygote.log_path, zygote.dir = log_path, directory
        zygote.socket = os.path.join(directory, "sock")
        zygote.popen = _Inherited(int(pid))  # type: ignore[assignment]
        return zygote

    @property
    def handle(self) -> str:
        """What :meth:`adopt` takes over in a process this one execs into."""
        return f"{self.pid}:{self.dir}"

    @property
    def pid(self) -> int:
        return self.popen.pid

    def release(self) -> str | None:
        """A stage is done with it: stop it, unless it is ``shared`` by a run's stages. Either way, why it had
        stopped serving on its own (its last words, or its exit status), else None."""
        if not self.shared:
            return self.stop()
        ended = self.popen.poll()
        return None if ended is None else self._ended(ended)

    def stop(self, grace_s: float = 5.0) -> str | None:
        """Stop it; why it had stopped serving on its own (its last words, or its exit status), else None."""

        ended = self.popen.poll()
        if ended is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
        return None if ended is None else self._ended(ended)

    def _ended(self, ended: int) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                last = [line.strip() for line in f if line.startswith("zygote: ")][-1:]
        except OSError:
            last = []
        words = last[0] if last and "ready on" not in last[0] and "forked worker" not in last[0] else ""
        return f"the zygote (pid {self.pid}) ended early with status {ended}" + (f": {words}" if words else "")


if __name__ == "__main__":
    sys.exit(main())
