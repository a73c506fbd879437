"""The code version of an installed copy without ``.git``: stamped once, when the copy is built.

The training image and any pip install from a source tree carry no git history, so
:func:`traingate.tracking.identity.code_version` cannot ask git. The build writes the version
into ``traingate/_build.py`` of the copy it installs (the Dockerfile from its ``CODE_VERSION``
build argument)::

    python -m traingate.tracking.stamp --sha 0123...cdef            # clean tree at that commit
    python -m traingate.tracking.stamp --from-git /path/to/checkout  # sha, dirty flag and diff hash of a checkout

A git checkout is never stamped: there git is read, and a stamp would go stale at the next commit.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import re
import subprocess
import sys
from pathlib import Path

from traingate.settings import code_dir

STAMP = Path("traingate") / "_build.py"
_SHA = re.compile(r"[0-9a-f]{40}")
_DIFF = re.compile(r"[0-9a-f]{16}")


class StampError(ValueError):
    """A stamp that cannot be written or read. One line: what, the value, the fix."""


def check(sha: str, dirty: str, diff_hash: str) -> dict[str, str]:
    """The stamp's fields, validated: a full sha, a dirty flag, a diff hash exactly when dirty.

    >>> check("a" * 40, "false", "")["dirty"]
    'false'
    >>> check("abc", "false", "")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    traingate.tracking.stamp.StampError: --sha 'abc' is not a full git commit sha (40 hex digits); pass `git
    rev-parse HEAD` of the tree you build from
    """
    if not _SHA.fullmatch(sha):
        raise StampError(
            f"--sha {sha!r} is not a full git commit sha (40 hex digits); pass `git rev-parse HEAD` "
            "of the tree you build from"
        )
    if dirty not in ("true", "false"):
        raise StampError(f"--dirty {dirty!r}: use true or false")
    if (dirty == "true") != bool(diff_hash) or (diff_hash and not _DIFF.fullmatch(diff_hash)):
        raise StampError(
            f"--diff-hash {diff_hash!r} with --dirty {dirty}: a dirty tree needs the 16-hex hash of "
            "its diff, a clean one none; build from a clean checkout or stamp with --from-git"
        )
    return {"sha": sha, "dirty": dirty, "diff_hash": diff_hash}


def write_stamp(code_dir: Path, sha: str, dirty: str = "false", diff_hash: str = "") -> Path:
    """Write ``code_dir``/traingate/_build.py; refused inside a git checkout (git is the version there)."""
    fields = check(sha, dirty, diff_hash)
    if (code_dir / ".git").exists():
        raise StampError(
            f"{code_dir} is a git checkout: its version is read from git; stamp the installed copy "
            "you build from it instead"
        )
    target = code_dir / STAMP
    if not target.parent.is_dir():
        raise StampError(f"{code_dir} holds no traingate package; pass the directory the code was installed into")
    target.write_text(
        '"""Written by traingate.tracking.stamp when this copy was built: its code version."""\n'
        f"CODE_VERSION = {fields!r}\n"
    )
    return target


def read_stamp(code_dir: Path) -> dict[str, str] | None:
    """The stamped version of ``code_dir``, or None when there is none. A malformed stamp is an error."""
    target = code_dir / STAMP
    if not target.is_file():
        return None
    tree = ast.parse(target.read_text())
    for node in tree.body:  # read, not imported: a stamp is data, and this may run before the copy is importable
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "CODE_VERSION" for t in node.targets):
            value = ast.literal_eval(node.value)
            try:
                return check(value["sha"], value["dirty"], value.get("diff_hash", ""))
            except (KeyError, TypeError, StampError) as e:
                raise StampError(
                    f"{target}: malformed stamp ({e}); rebuild the copy or rewrite it with "
                    "python -m traingate.tracking.stamp"
                ) from None
    raise StampError(f"{target} has no CODE_VERSION; rewrite it with python -m traingate.tracking.stamp")


def git_version(root: Path) -> dict[str, str] | None:
    """sha, dirty flag and diff hash (when dirty) of the git checkout whose top is ``root``, else None.

    A repository that merely encloses ``root`` (a venv inside some checkout) is not its version.
    """

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30, check=True).stdout

    try:
        top = Path(git("rev-parse", "--show-toplevel").strip()).resolve()
        sha = git("rev-parse", "HEAD").strip() if top == root else ""
    except (subprocess.CalledProcessError, FileNotFoundError, subprocess.TimeoutExpired, NotADirectoryError):
        sha = ""
    if not sha:
        return None
    diff = git("diff", "HEAD")
    untracked = git("ls-files", "--others", "--exclude-standard")
    dirty = bool(diff.strip() or untracked.strip())
    return {
        "sha": sha,
        "dirty": str(dirty).lower(),
        "diff_hash": hashlib.sha256((diff + untracked).encode()).hexdigest()[:16] if dirty else "",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m traingate.tracking.stamp", description=__doc__.split("\n\n")[0])
    p.add_argument("--sha", help="the commit the copy was built from")
    p.add_argument("--dirty", default="false", help="true if the tree had uncommitted changes (then --diff-hash)")
    p.add_argument("--diff-hash", default="", help="16 hex digits identifying the uncommitted changes")
    p.add_argument("--from-git", metavar="CHECKOUT", help="read sha, dirty flag and diff hash from this checkout")
    p.add_argument("--into", metavar="CODE_DIR", help="the installed copy (default: the one this runs from)")
    args = p.parse_args(argv)
    try:
        if bool(args.sha) == bool(args.from_git):
            raise StampError(
                "pass exactly one of --sha SHA (building the image: --build-arg "
                "CODE_VERSION=$(git rev-parse HEAD)) or --from-git CHECKOUT"
            )
        if args.from_git:
            v = git_version(Path(args.from_git).resolve())
            if v is None:
                raise StampError(f"--from-git {args.from_git!r} is not the top of a git checkout")
            args.sha, args.dirty, args.diff_hash = v["sha"], v["dirty"], v["diff_hash"]
        path = write_stamp(Path(args.into).resolve() if args.into else code_dir(), args.sha, args.dirty, args.diff_hash)
    except StampError as e:
        print(f"traingate stamp: {e}", file=sys.stderr)
        return 2
    print(f"stamped {path}: {args.sha}{' (dirty, diff ' + args.diff_hash + ')' if args.dirty == 'true' else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
