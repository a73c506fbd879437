"""Where a run may keep its files and read its data: on a disk, not the filesystem root or the kernel's
trees (/proc, /sys, /dev), and from regular files or directories, not FIFOs, sockets or devices, whose
reads block or never end. Plain functions of a path; errors are one-line SpecErrors.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from traingate.spec import SpecError

# Filesystems whose files are views of kernel state or devices: nothing written there is kept, and
# reading them can block (/proc/kmsg) or never end.
_KERNEL_FS = frozenset(
    {
        "proc",
        "sysfs",
        "devtmpfs",
        "devpts",
        "cgroup",
        "cgroup2",
        "debugfs",
        "tracefs",
        "securityfs",
        "pstore",
        "bpf",
        "configfs",
        "fusectl",
        "mqueue",
        "binfmt_misc",
        "efivarfs",
        "nsfs",
        "rpc_pipefs",
        "autofs",
        "hugetlbfs",
    }
)
# The same trees by name: in a container /dev or /sys/fs/cgroup is often a plain tmpfs.
_KERNEL_TREES = ("/proc", "/sys", "/dev")
_SHARED_MEMORY = "/dev/shm"  # a tmpfs meant for files, under /dev by convention


def _mounts() -> list[tuple[str, str]]:
    """(mount point, filesystem type) of this process's mounts, from /proc/self/mountinfo."""
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) >= 5 and right:
            point = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
            out.append((point, right.split()[0]))
    return out


def place_problem(path: str | Path) -> str | None:
    """Why ``path`` is no place for a run's files or data (the root, a kernel filesystem), or None.

    >>> place_problem("/"), place_problem("/proc/x") is not None, place_problem("/tmp/x")
    ('is the filesystem root; give a directory of its own, e.g. /srv/traingate', True, None)
    """
    real = Path(os.path.abspath(path))
    try:
        real = real.resolve()
    except (OSError, RuntimeError):  # a symlink loop: the probes that follow name it
        pass
    if real == Path("/"):
        return "is the filesystem root; give a directory of its own, e.g. /srv/traingate"
    text = str(real)
    inside = [m for m in _mounts() if text == m[0] or text.startswith(m[0].rstrip("/") + "/")]
    point, fstype = max(inside, key=lambda m: len(m[0])) if inside else ("/", "")
    tree = next((t for t in _KERNEL_TREES if text == t or text.startswith(t + "/")), None)
    shm = text == _SHARED_MEMORY or text.startswith(_SHARED_MEMORY + "/")
    if fstype in _KERNEL_FS or (tree is not None and not shm):
        where = f"the kernel's {fstype} filesystem at {point}" if fstype in _KERNEL_FS else f"{tree}, the kernel's tree"
        return f"is on {where}, which holds kernel state and devices, not files; choose a location on a disk"
    return None


KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def special_kind(path: str | Path) -> str | None:
    """'a FIFO (named pipe)', 'a character device', ... for what is neither a regular file nor a
    directory (reading one blocks, or never ends); None otherwise, or when it does not exist."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return next((kind for test, kind in KINDS if test(mode)), None)


def check_local_data(field: str, shown: str, path: str | Path, dir_ok: bool = True) -> None:
    """Local data that can be read to its end: a regular file (or a directory, when ``dir_ok``) on a disk."""
    problem = place_problem(path)
    if problem:
        raise SpecError(f"{field} = {shown!r}: {problem}")
    kind = special_kind(path)
    if kind:
        want = "a regular file or a directory" if dir_ok else "a regular file"
        raise SpecError(f"{field} = {shown!r}: is {kind}, not data that can be read to its end; point it at {want}")
