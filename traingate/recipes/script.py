"""The ``script`` recipe: an existing training command, run unmodified, read through its output.

Metrics come from named-group regexes declared in the spec; a group named ``step``
gives the step, one named ``total`` the script's own step total (``step 10/200``: progress and ETA
count to it), every other named group is a metric.

>>> series = extract_metrics("step 1 loss=2.5\\nstep 2 loss=1.5\\n", [r"step (?P<step>\\d+) loss=(?P<loss>\\S+)"])
>>> series["loss"]
[(1, 2.5), (2, 1.5)]
>>> summarize(series)["loss_decrease_fraction"]
0.4
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

import fsspec

from traingate.job import files
from traingate.secrets import resolve
from traingate.spec import RunSpec, SpecError
from traingate.storage import Storage, storage_options

PYTHONS = ("python", "python3")
# ${TRAINGATE_...} in an argument; ${env:NAME} (a secret) is not matched: it never goes into argv from here.
_PLATFORM_REF = re.compile(r"\$\{(TRAINGATE_[A-Za-z0-9_]*)\}")


def build_command(
    spec: RunSpec,
    stage: str,
    python: str,
    nproc: int,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    values: Mapping[str, str] | None = None,
    resume: bool = False,
    log_dir: str | None = None,
) -> list[str]:
    """The command line for one stage of a script recipe: stage args appended, then ``resume_args`` when
    ``resume``; ``${TRAINGATE_...}`` words expanded from ``values`` (envvars.script_arg_values); under torchrun,
    its per-rank files (a rank's ``error.json``) in ``log_dir``.

    >>> from traingate.spec import load_spec_text
    >>> spec = load_spec_text("identity: {experiment: e, owner: o, team: t, purpose: p}\\n"
    ...     "recipe: {name: script, script: {command: [./train.sh, --out, '${TRAINGATE_CHECKPOINT_DIR}'], "
    ...     "resume_args: [--resume]}}")
    >>> from traingate.job.envvars import CHECKPOINT_DIR
    >>> build_command(spec, "full", "py", 1, values={CHECKPOINT_DIR: "/ck"}, resume=True)
    ['./train.sh', '--out', '/ck', '--resume']
    """
    s = spec.recipe.script
    assert s is not None
    extra = next((a for k, a in s.stage_args.items() if k == stage), [])
    cmd = [*s.command, *extra, *(s.resume_args if resume else [])]
    if values is not None:
        cmd = expand(cmd, values, "recipe.script.command")
    if s.launcher == "torchrun":
        if cmd[0] not in PYTHONS:
            raise ValueError(
                f"recipe.script.command = {s.command!r}: launcher torchrun needs a python command "
                "('python train.py ...' or 'python -m pkg'); use launcher: plain otherwise"
            )
        return [
            python,
            "-m",
            "torch.distributed.run",
            *torchrun_args(nproc, nnodes, rdzv_endpoint, log_dir),
            *cmd[1:],
        ]
    if cmd[0] in PYTHONS:
        cmd[0] = python  # the environment traingate runs in, not whatever `python` is on PATH
    return cmd


def interpreter_note(spec: RunSpec, python: str) -> str | None:
    """The line that says which interpreter runs the word ``python`` (or ``python3``) of a script's command,
    or None when the command starts with anything else (it runs as written).

    It is ``python``, the interpreter traingate runs in: under ``launcher: torchrun`` torch's launcher
    (``python -m torch.distributed.run``) must run where torch is installed, and a plain command gets the
    same so both launchers run the script alike, whatever ``python`` the supervisor's PATH finds first.

    >>> from traingate.spec import load_spec_text
    >>> spec = load_spec_text("identity: {experiment: e, owner: o, team: t, purpose: p}\\n"
    ...     "recipe: {name: script, script: {command: [python, train.py]}}")
    >>> print(interpreter_note(spec, "/venv/bin/python"))  # doctest: +ELLIPSIS
    `python` in recipe.script.command runs /venv/bin/python (traingate's interpreter, ...
    """
    s = spec.recipe.script
    if s is None or s.command[0] not in PYTHONS:
        return None
    return (
        f"`{s.command[0]}` in recipe.script.command runs {python} (traingate's interpreter, where torch and "
        "traingate are installed); to use another one, write its full path as the command's first word "
        "(launcher: plain)"
    )


def expand(words: list[str], values: Mapping[str, str], field: str) -> list[str]:
    """``words`` with every ``${TRAINGATE_NAME}`` replaced by its value; an unknown name is a SpecError."""
    out = []
    for i, word in enumerate(words):

        def value(m: re.Match[str], i: int = i, word: str = word) -> str:
            name = m.group(1)
            if name not in values:
                raise SpecError(
                    f"{field}[{i}] = {word!r}: ${{{name}}} is not a location traingate provides; use "
                    f"one of {', '.join('${' + v + '}' for v in sorted(values))}"
                )
            return values[name]

        out.append(_PLATFORM_REF.sub(value, word))
    return out


def check_args(spec: RunSpec, names: tuple[str, ...]) -> None:
    """Refuse, before anything starts, an argument that names a ``${TRAINGATE_...}`` not in ``names``."""
    s = spec.recipe.script
    assert s is not None
    stand_in = {n: "x" for n in names}
    expand(s.command, stand_in, "recipe.script.command")
    for stage, words in s.stage_args.items():
        expand(words, stand_in, f"recipe.script.stage_args.{stage}")
    expand(s.resume_args, stand_in, "recipe.script.resume_args")


def torchrun_args(
    nproc: int, nnodes: int = 1, rdzv_endpoint: str | None = None, log_dir: str | None = None
) -> list[str]:
    """torchrun's arguments. ``log_dir``: where its agent makes its per-launch directory of per-rank files (a
    rank's ``error.json``); without one it makes a ``torchelastic_*`` directory in the system's temp directory
    per launch and never removes it.

    >>> torchrun_args(2, log_dir="/runs/r/full/torchelastic")
    ['--standalone', '--nproc_per_node=2', '--log-dir=/runs/r/full/torchelastic']
    """
    logs = [f"--log-dir={log_dir}"] if log_dir is not None else []
    if nnodes > 1:
        assert rdzv_endpoint, "validated by ResourcesSpec"
        return [
            f"--nnodes={nnodes}",
            f"--nproc_per_node={nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv_endpoint}",
            *logs,
        ]
    return ["--standalone", f"--nproc_per_node={nproc}", *logs]


def extract_metrics(text: str, patterns: list[str]) -> dict[str, list[tuple[int, float]]]:
    """All (step, value) pairs each named group matched, in output order.

    Lines without a ``step`` group get a running index per metric.
    """
    compiled = [re.compile(p) for p in patterns]
    series: dict[str, list[tuple[int, float]]] = {}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        for name, step, value in _line_points(compiled, line, counts):
            series.setdefault(name, []).append((step, value))
    return series


TOTAL = "total"  # the named group that holds a script's own step total


def reported_total(line: str, patterns: list[re.Pattern[str]]) -> int | None:
    """The step total a line reports through a ``total`` group (the last one it matches), or None.

    >>> reported_total("step 10/200 loss 2.5", [re.compile(r"step (?P<step>\\d+)/(?P<total>\\d+) loss (?P<loss>\\S+)")])
    200
    >>> reported_total("step 10 loss 2.5", [re.compile(r"step (?P<step>\\d+)(/(?P<total>\\d+))? loss (?P<loss>\\S+)")])
    """
    total = None
    for rx in patterns:
        if TOTAL not in rx.groupindex:
            continue
        for m in rx.finditer(line):
            raw = m.group(TOTAL)
            if raw is not None and raw.isdigit() and int(raw) > 0:
                total = int(raw)
    return total


def _line_points(compiled: list[re.Pattern[str]], line: str, counts: dict[str, int]) -> list[tuple[str, int, float]]:
    """(metric, step, value) for every named group the patterns match in one line; a metric without a
    ``step`` group gets its running index (``counts``, updated)."""
    out = []
    for rx in compiled:
        for m in rx.finditer(line):
            groups = m.groupdict()
            step = groups.pop("step", None)
            groups.pop(TOTAL, None)  # the script's step total: progress, not a metric
            for name, raw in groups.items():
                if raw is None:
                    continue
                try:
                    value = float(raw)
                except ValueError:
                    continue
                n = counts.get(name, 0)
                counts[name] = n + 1
                out.append((name, int(step) if step is not None else n, value))
    return out


def series_of_attempts(points: list[files.ScriptPoint]) -> dict[str, list[tuple[int, float, float]]]:
    """Each metric's (step, value, time) over a stage's attempts, in the order they were read, where a
    restarted attempt's points replace those of earlier attempts at the steps it ran again: the last
    value of a series is the latest attempt's final value.

    >>> P = files.ScriptPoint
    >>> series_of_attempts([P("val_loss", 40, 0.9, 1.0, 0), P("val_loss", 50, 0.8, 2.0, 0),
    ...                     P("val_loss", 50, 0.5, 3.0, 1)])["val_loss"]
    [(40, 0.9, 1.0), (50, 0.5, 3.0)]
    """
    out: dict[str, list[tuple[int, float, float]]] = {}
    attempt_of: dict[str, int] = {}
    for p in sorted(points, key=lambda p: (p.attempt, p.time)):
        seq = out.setdefault(p.name, [])
        if attempt_of.get(p.name, p.attempt) != p.attempt:
            seq[:] = [q for q in seq if q[0] < p.step]  # the steps this attempt runs again are its own
        attempt_of[p.name] = p.attempt
        seq.append((p.step, p.value, p.time))
    return out


def summarize(series: dict[str, list[tuple[int, float]]]) -> dict[str, float]:
    """Gate-ready numbers: each metric's final/first/min/max; for *loss*: decrease and non-finite count."""
    out: dict[str, float] = {}
    nonfinite = 0
    steps = 0
    for name, points in series.items():
        values = [v for _, v in points]
        finite = [v for v in values if math.isfinite(v)]
        steps = max(steps, max(s for s, _ in points))
        if "loss" in name:
            nonfinite += len(values) - len(finite)
        if not finite:
            continue
        out[name] = finite[-1]
        out[f"{name}_first"] = finite[0]
        out[f"{name}_min"] = min(finite)
        out[f"{name}_max"] = max(finite)
    loss_key = "loss" if "loss" in out else ("train_loss" if "train_loss" in out else None)
    if loss_key:
        k = max(1, min(5, len(series[loss_key]) // 4))
        vals = [v for _, v in series[loss_key] if math.isfinite(v)]
        first, last = sum(vals[:k]) / k, sum(vals[-k:]) / k
        out["loss_decrease_fraction"] = (first - last) / first if first > 0 else 0.0
    out["nonfinite_steps"] = float(nonfinite)
    out["steps"] = float(steps)
    return out


def unmatched(patterns: list[str], text: str, tail: int = 5) -> str:
    """Why a script stage whose output no metric regex matched fails: traingate saw no training step, so
    nothing it gates on was measured. One line naming the regexes and showing the script's last lines.

    >>> unmatched(["loss=(?P<loss>[0-9.]+)"], "epoch 1 loss: 0.5\\ndone\\n")  # doctest: +NORMALIZE_WHITESPACE
    "no line of the script's output matched recipe.script.metrics 'loss=(?P<loss>[0-9.]+)', so it trained no step
    traingate can see; fix the regex or what the script prints (last lines: 'epoch 1 loss: 0.5' | 'done')"
    """
    last = [line.strip()[:120] for line in text.splitlines() if line.strip()][-tail:]
    shown = " | ".join(repr(line) for line in last) if last else "it printed nothing"
    regexes = ", ".join(f"'{p}'" for p in patterns)  # as written in the spec, not repr's doubled backslashes
    return (
        f"no line of the script's output matched recipe.script.metrics {regexes}, so it trained no step "
        f"traingate can see; fix the regex or what the script prints (last lines: {shown})"
    )


# ---------------------------------------------------------------- output progress (the heartbeat of a script)


class OutputProgress:
    """What a script's output says about its progress, for hang detection: the lines it printed and
    the last step its metric regexes matched (``step`` groups). Fed line by line from the output reader.

    ``step_progress``: progress is the metric step (the spec's regexes name one), else the line count.
    ``stage_dir``: every metric value is also appended there (:class:`files.ScriptPoint`) with the time its
    line arrived and this launch's ``attempt``: the real step and time of each point, over every attempt.
    """

    def __init__(self, patterns: list[str], stage_dir: Path | None = None, attempt: int = 0):
        self._rx = [re.compile(p) for p in patterns]
        self._step_rx = [rx for rx in self._rx if "step" in rx.groupindex]
        self.step_progress = bool(self._step_rx)
        self.lines = 0
        self.step: int | None = None
        self.last: float | None = None  # when progress was last made (time.time())
        self._lock = threading.Lock()
        self._stage_dir, self._attempt = stage_dir, attempt
        self._counts: dict[str, int] = {}  # points per metric without a step group (their running index)
        self.total: int | None = None  # the step total the script reports (a ``total`` group), if any

    def feed(self, line: str) -> None:
        step = None
        for rx in self._step_rx:
            for m in rx.finditer(line):
                if m.group("step") is not None:
                    step = int(m.group("step"))
        total = reported_total(line, self._rx)
        if self._stage_dir is not None:
            self._record(line, time.time())
            if total is not None and total != self.total:  # written when it changes, not every line
                files.write_script_total(self._stage_dir, total)
        if total is not None:
            self.total = total
        with self._lock:
            self.lines += 1
            if step is not None and step != self.step:
                self.step = step
                if self.step_progress:
                    self.last = time.time()
            if not self.step_progress:
                self.last = time.time()

    def _record(self, line: str, now: float) -> None:
        points = []
        for name, step, value in _line_points(self._rx, line, self._counts):
            points.append(files.ScriptPoint(name, step, value, now, self._attempt))
        if points:
            assert self._stage_dir is not None
            files.append_script_points(self._stage_dir, points)

    def reading(self) -> tuple[int, float] | None:
        """(progress counter, when it last advanced), or None before the first progress."""
        with self._lock:
            if self.last is None:
                return None
            return (self.step if self.step_progress and self.step is not None else self.lines), self.last

    def hook(self, then: Callable[[str], None] | None) -> Callable[[str], None]:
        def on_line(line: str) -> None:
            self.feed(line)
            if then is not None:
                then(line)

        return on_line


# ---------------------------------------------------------------- the checkpoints a script writes

INDEX = ".traingate-index.json"  # at the checkpoint root; a dot-file, so no script glob matches it
_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class ScriptCheckpoint:
    """One file the script wrote that its ``recipe.script.checkpoints`` glob declares."""

    path: str  # relative to the checkpoint dir, '/'-separated
    size: int
    sha256: str
    step: int | None  # the last number in the file's name (ckpt_000040.pt -> 40), if any
    mtime: float


def step_of(name: str) -> int | None:
    """The step a checkpoint's file name holds: its last number.

    >>> step_of("ckpt_000040.pt"), step_of("epoch3-step120.pt"), step_of("last.pt")
    (40, 120, None)
    """
    found = _DIGITS.findall(PurePosixPath(name).name.split(".")[0])
    return int(found[-1]) if found else None


def check_glob(pattern: str) -> None:
    p = PurePosixPath(pattern)
    if p.is_absolute() or ".." in p.parts or pattern.startswith("$"):
        raise SpecError(
            f"recipe.script.checkpoints = {pattern!r}: a glob relative to ${{TRAINGATE_CHECKPOINT_DIR}} "
            "is expected; write e.g. 'ckpt_*.pt' or 'epoch_*/model.pt'"
        )


def _declared(local_dir: Path, pattern: str | None) -> list[Path]:
    if not local_dir.is_dir():
        return []
    found = local_dir.glob(pattern) if pattern else local_dir.rglob("*")
    return sorted(p for p in found if p.is_file() and p.name != INDEX and not p.name.startswith(f"{INDEX}."))


def has_checkpoint(local_dir: str | Path, pattern: str | None) -> bool:
    """Whether the script has written a checkpoint: its glob matches a file (no glob: the dir is not empty)."""
    return bool(_declared(Path(local_dir), pattern))


def latest_step(local_dir: str | Path, pattern: str | None) -> int | None:
    """The step in the name of the newest declared checkpoint (None: none, or its name holds no number).
    By file times alone: a restart's log line must not wait for hashing gigabytes."""
    found = _declared(Path(local_dir), pattern)
    if not found:
        return None
    last = max(found, key=lambda p: (p.stat().st_mtime, step_of(p.name) or -1, p.as_posix()))
    return step_of(last.relative_to(local_dir).as_posix())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def index_checkpoints(
    local_dir: str | Path, pattern: str | None, known: Mapping[str, ScriptCheckpoint] | None = None
) -> list[ScriptCheckpoint]:
    """Every declared checkpoint file under ``local_dir``, oldest first. ``known``: an earlier index; a file
    with the same size and mtime keeps its hash (a multi-GB file is not re-read after every attempt)."""
    root = Path(local_dir)
    out = []
    for p in _declared(root, pattern):
        st = p.stat()
        rel = p.relative_to(root).as_posix()
        old = (known or {}).get(rel)
        same = old is not None and old.size == st.st_size and old.mtime == st.st_mtime
        out.append(
            ScriptCheckpoint(rel, st.st_size, old.sha256 if same and old else _sha256(p), step_of(rel), st.st_mtime)
        )
    return sorted(out, key=lambda c: (c.mtime, c.step if c.step is not None else -1, c.path))


def newest(entries: list[ScriptCheckpoint]) -> ScriptCheckpoint | None:
    """The last checkpoint written (by time; the step in the name breaks a tie)."""
    return entries[-1] if entries else None


def read_index(uri: str) -> list[ScriptCheckpoint]:
    """The index published at a checkpoint URI ([] when there is none)."""

    store = Storage(uri)
    if not store.exists(INDEX):
        return []
    data = json.loads(store.read_bytes(INDEX))
    return [ScriptCheckpoint(**e) for e in data["checkpoints"]]


def publish(local_dir: str | Path, pattern: str | None, uri: str) -> list[ScriptCheckpoint]:
    """Index the declared checkpoints in ``local_dir`` and make ``uri`` hold them and the index.

    A remote URI gets every new or changed file, loses the files the script has since deleted (its own
    retention), and gets the index last: an index names only files that are there.
    """

    store = Storage(uri)
    before = {c.path: c for c in read_index(uri)}
    entries = index_checkpoints(local_dir, pattern, before)
    local = store.is_local and Path(store.uri().removeprefix("file://")).resolve() == Path(local_dir).resolve()
    if not local:
        fs, root = _filesystem(uri)
        for c in entries:
            old = before.get(c.path)
            if old is None or old.sha256 != c.sha256:
                if store.is_local:  # a local copy does not make its parents; S3 has none to make
                    fs.makedirs(str(PurePosixPath(root) / c.path).rsplit("/", 1)[0], exist_ok=True)
                store.put_file(str(Path(local_dir) / c.path), c.path)
    last = newest(entries)
    index = {"checkpoints": [asdict(c) for c in entries], "newest": last.path if last is not None else None}
    store.write_bytes(INDEX, json.dumps(index, indent=1).encode())
    if not local:
        for gone in set(before) - {c.path for c in entries}:
            store.rm(gone)
    return entries


def restore(uri: str, local_dir: str | Path, pattern: str | None) -> list[ScriptCheckpoint]:
    """Bring a published checkpoint set back into an empty ``local_dir`` (a resume on another host):
    the files the index names, each checked against its sha256. Nothing happens when the dir has one."""

    root = Path(local_dir)
    store = Storage(uri)
    if has_checkpoint(root, pattern) or (store.is_local and Path(store.uri().removeprefix("file://")) == root):
        return []
    entries = read_index(uri)
    for c in entries:
        dest = root / c.path
        fetch(uri, c, dest)
    return entries


def fetch(uri: str, c: ScriptCheckpoint, dest: Path) -> Path:
    """Copy checkpoint ``c`` from ``uri`` to ``dest``, verified against its sha256 (OSError if it differs)."""

    store = Storage(uri)  # its retry policy; the copy streams to disk instead of reading the file into memory
    fs, root = _filesystem(uri)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.part")
    store.retry(f"download {c.path}", lambda: fs.get_file(f"{root.rstrip('/')}/{c.path}", str(tmp)))
    got = _sha256(tmp)
    if got != c.sha256:
        tmp.unlink()
        raise OSError(
            f"checkpoint {store.uri(c.path)}: sha256 {got[:12]}... differs from its index's "
            f"{c.sha256[:12]}...; it was changed after it was published"
        )
    tmp.replace(dest)
    return dest


def _filesystem(uri: str):  # -> (fsspec filesystem, root path)

    resolved = resolve(uri, field="checkpoint location")
    return fsspec.core.url_to_fs(resolved, **storage_options(resolved))
