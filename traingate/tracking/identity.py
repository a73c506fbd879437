"""Run identity: who, why, which code, which data, which environment."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import fsspec
import pynvml

from traingate.settings import code_dir
from traingate.storage import storage_options
from traingate.tracking.stamp import git_version, read_stamp

# A run without every one of these (plus the spec params and the spec and environment
# artifacts, see traingate.tracking.runs.identity_problems) is not valid and is not promoted.
REQUIRED_TAGS = (
    "traingate.run_id",
    "traingate.experiment",
    "traingate.owner",
    "traingate.team",
    "traingate.purpose",
    "traingate.recipe",
    "traingate.code_version",
    "traingate.code_dirty",
    "traingate.data_snapshot",
    "traingate.data_uri",
    "traingate.spec_hash",
)


def code_version(path: str | Path | None = None) -> dict[str, str]:
    """git sha + dirty flag (+ a hash of the diff when dirty) of the code directory, and where it was read.

    ``path`` defaults to the directory this code runs from (:func:`traingate.settings.code_dir`): a git
    checkout is read with git (``source: git``); an installed copy without ``.git`` (the training
    image, a pip install) by the stamp written when it was built (``source: stamp``, see
    :mod:`traingate.tracking.stamp`). Neither: ``unknown``, and the run cannot be promoted.
    A git repository that merely encloses ``path`` (a venv inside some checkout) is not its version.
    """
    root = Path(path).resolve() if path is not None else code_dir()
    checked_out = git_version(root)
    if checked_out is not None:
        return {**checked_out, "source": "git"}
    stamped = read_stamp(root)
    if stamped is not None:
        return {**stamped, "source": "stamp"}
    return {"sha": "unknown", "dirty": "unknown", "diff_hash": "", "source": "none"}


# Never part of a project's content: git's own store and what Python caches beside the code.
_SKIP_DIRS = frozenset({".git", "__pycache__"})
_SKIP_SUFFIXES = (".pyc",)


def content_version(root: str | Path, exclude: tuple[str | Path, ...] = ()) -> dict[str, str]:
    """The code version of a directory without git: sha256 over every file's relative path and bytes, in
    path order (``source: content``). Skips .git, __pycache__, *.pyc and the ``exclude`` directories (the
    state dir, when a project keeps it inside). A symlink counts as its target text, never followed.

    >>> import tempfile; d = Path(tempfile.mkdtemp()); _ = (d / "train.py").write_text("print(1)")
    >>> v = content_version(d); v["source"], v["sha"][:7], v["dirty"]
    ('content', 'sha256:', 'false')
    >>> _ = (d / "train.py").write_text("print(2)"); content_version(d)["sha"] != v["sha"]
    True
    """

    top = Path(root).resolve()
    skip = {Path(e).resolve() for e in exclude}
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(top):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in _SKIP_DIRS and (here / d).resolve() not in skip and not (here / d).is_symlink()
        )
        for name in sorted(
            [*filenames, *(d for d in os.listdir(here) if (here / d).is_symlink() and (here / d).is_dir())]
        ):
            path = here / name
            if name.endswith(_SKIP_SUFFIXES):
                continue
            rel = path.relative_to(top).as_posix()
            h.update(f"{len(rel)}:{rel}\0".encode())
            if path.is_symlink():
                h.update(b"link:" + os.readlink(path).encode())
                continue
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
            h.update(b"\0")
    # Every byte is in the hash, so there is nothing uncommitted to flag.
    return {"sha": f"sha256:{h.hexdigest()}", "dirty": "false", "diff_hash": "", "source": "content"}


def script_code_version(workdir: str | Path, state_dir: str | Path | None = None) -> dict[str, str]:
    """The code version of a script project: git's (sha + dirty, this directory's changes) when the workdir is
    in a git work tree, else :func:`content_version` of the workdir, so a git-less project is still promotable."""
    root = Path(workdir).resolve()
    # The three questions are asked at once (each git start is a fork of this process); outside a work tree all fail.
    try:
        head, diff, untracked = _git_outputs(
            root,
            ["rev-parse", "HEAD"],
            ["diff", "HEAD", "--", "."],
            ["ls-files", "--others", "--exclude-standard", "--", "."],
        )
    except (FileNotFoundError, NotADirectoryError):
        head = diff = untracked = None
    sha = head.strip() if head is not None else ""
    if not sha:
        return content_version(root, exclude=(state_dir,) if state_dir is not None else ())
    if diff is None or untracked is None:
        raise RuntimeError(f"git cannot say what changed in {root} at {sha} (git diff / git ls-files failed)")
    dirty = bool(diff.strip() or untracked.strip())
    return {
        "sha": sha,
        "dirty": str(dirty).lower(),
        "source": "git",
        "diff_hash": hashlib.sha256((diff + untracked).encode()).hexdigest()[:16] if dirty else "",
    }


def _git_outputs(root: Path, *commands: list[str], timeout_s: float = 30.0) -> list[str | None]:
    """The output of each ``git`` command run in ``root``, all started at once; None for one that failed."""
    procs = [
        subprocess.Popen(["git", *args], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for args in commands
    ]
    outs: list[str | None] = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            out = None
        outs.append(out if p.returncode == 0 else None)
    return outs


def run_code_version(spec: Any, state_dir: str | Path | None = None) -> dict[str, str]:
    """The code a run trains with: a script recipe's project (its workdir), else traingate's own code."""
    script = spec.recipe.script
    if script is not None:
        return script_code_version(script.workdir, state_dir)
    return code_version()


def commit_mismatch(commit: str, version: dict[str, str]) -> str | None:
    """Why code at ``version`` is not the ``commit`` CI asked for (None when it is: the same commit, clean).

    >>> commit_mismatch("0123abc", {"sha": "0123abc" + "0" * 33, "dirty": "false", "source": "git"}) is None
    True
    >>> unknown = {"sha": "unknown", "dirty": "unknown", "source": "none"}
    >>> commit_mismatch("0123abc", unknown)  # doctest: +NORMALIZE_WHITESPACE
    'commit 0123abc was asked for, but the code here is unknown (source: none); the ci deployment checks the commit
    out in its pull step (TRAINGATE_CI_REPOSITORY on the pool or worker)'
    """
    c = commit.strip().lower()
    if len(c) < 7 or any(ch not in "0123456789abcdef" for ch in c):
        return f"commit = {commit!r}: pass a git commit sha (at least 7 hex digits), e.g. $(git rev-parse HEAD)"
    sha = version.get("sha", "unknown")
    if sha.startswith(c) and version.get("dirty") == "false":
        return None
    what = f"{sha}{' with uncommitted changes' if version.get('dirty') == 'true' else ''}"
    return (
        f"commit {commit} was asked for, but the code here is {what} (source: {version.get('source', '?')}); "
        "the ci deployment checks the commit out in its pull step (TRAINGATE_CI_REPOSITORY on the pool or worker)"
    )


def hash_file_uri(uri: str) -> str:
    """The content hash of the data at ``uri``: a file's bytes, or a directory's files (relative paths and
    bytes, in path order), so a script's ``data.uri`` may name either."""

    fs, root = fsspec.core.url_to_fs(uri, **storage_options(uri))
    h = hashlib.sha256()
    # An http(s) URL is one object: asking HTTP whether it is a "directory" would download and parse it.
    web = {"http", "https"} & set(fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    if web or not fs.isdir(root):
        with fs.open(root, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        return h.hexdigest()
    base = root.rstrip("/")
    for path in sorted(fs.find(base)):
        rel = path[len(base) :].lstrip("/")
        h.update(f"{len(rel)}:{rel}\0".encode())
        with fs.open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        h.update(b"\0")
    return "dir-" + h.hexdigest()


def environment_snapshot() -> dict[str, Any]:
    """The run's environment: interpreter, machine, torch build, installed packages, GPUs.

    Read without importing torch (seconds): the ladder's flow records it as the run opens, and a script
    recipe's flow never loads torch at all.
    """
    packages = installed_packages()
    build = torch_build()
    cuda = build.get("cuda")
    snap: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu": platform.processor() or platform.machine(),
        "torch": build.get("__version__", "none"),
        "cuda": cuda or "none",
        "cudnn": _cudnn(cuda, packages),
        "packages": sorted(f"{name}=={v}" for name, v in packages.items()),
    }
    snap["gpus"] = gpu_inventory()
    return snap


_packages: dict[tuple[tuple[str, int], ...], dict[str, str]] = {}


def installed_packages() -> dict[str, str]:
    """Name -> version of every distribution on ``sys.path``.

    Reading every package's metadata takes 0.1-0.2 s; a process that opens many runs (the CLI engine, whose
    forked commands inherit what it read) reads it again only when a ``sys.path`` directory changed (an
    install or removal adds or removes a ``*.dist-info`` entry there, which changes the directory's mtime).
    """
    key = tuple((p, os.stat(p).st_mtime_ns) for p in sys.path if p and os.path.isdir(p))
    if key not in _packages:
        _packages.clear()
        _packages[key] = {d.metadata["Name"]: d.version for d in metadata.distributions() if d.metadata["Name"]}
    return dict(_packages[key])


def torch_build() -> dict[str, Any]:
    """The constants of the installed torch's ``torch/version.py`` (``__version__``, ``cuda``, ``git_version``),
    read from the file without importing torch; empty when torch is not installed."""
    found = importlib.util.find_spec("torch")
    if found is None or not found.submodule_search_locations:
        return {}
    tree = ast.parse(Path(next(iter(found.submodule_search_locations)), "version.py").read_text())
    out: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            try:
                out[target.id] = ast.literal_eval(value)
            except ValueError:  # not a constant (the file is generated with constants; this one is not recorded)
                continue
    return out


def _cudnn(cuda: str | None, packages: dict[str, str]) -> str:
    """The cuDNN a CUDA build of torch loads: the version of its ``nvidia-cudnn-cu<major>`` wheel."""
    if not cuda:
        return "none"
    return packages.get(f"nvidia-cudnn-cu{cuda.split('.')[0]}", "not from a wheel (a system library)")


def gpu_inventory() -> list[dict[str, Any]]:
    """GPU model and driver via NVML; an empty list where there is no NVIDIA driver (a normal state)."""
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound etc.: no GPU here, not an error
        return []
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            out.append(
                {
                    "index": i,
                    "name": pynvml.nvmlDeviceGetName(h),
                    "driver": driver,
                    "memory_mb": pynvml.nvmlDeviceGetMemoryInfo(h).total // 2**20,
                }
            )
        return out
    finally:
        pynvml.nvmlShutdown()
