"""Pull step of the `ci-canary` deployment: check out the commit the flow run was asked to test.

A pull step sees no flow-run parameters, so this reads the run's `commit` parameter from the
Prefect API (the worker sets PREFECT__FLOW_RUN_ID and PREFECT_API_URL for the run's process),
checks that commit out of TRAINGATE_CI_REPOSITORY into the pool's state directory
(``$TRAINGATE_STATE_DIR/ci/<sha>``, never the worker's own code directory) and prints the
directory; the next pull step makes it the run's working directory, so the flow, its tasks and
`traingate` are imported from the commit (Prefect puts the working directory first on sys.path).

Run by `run_shell_script` in its own process, so nothing here is imported into the flow run.
Prints only the directory on stdout; every problem is one line on stderr and exit 2.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

_SHA = re.compile(r"[0-9a-fA-F]{7,40}")


class CheckoutError(Exception):
    pass


def _git(*args: str, cwd: Path | None = None) -> str:
    p = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise CheckoutError(f"git {' '.join(args)} failed: {(p.stderr or p.stdout).strip().splitlines()[-1:]}")
    return p.stdout.strip()


def requested_commit(flow_run_id: str) -> str:
    from prefect import get_client

    with get_client(sync_client=True) as c:
        commit = (c.read_flow_run(flow_run_id).parameters or {}).get("commit")
    if not commit or not _SHA.fullmatch(str(commit)):
        raise CheckoutError(f"commit = {commit!r}: the ci-canary deployment tests one commit; trigger it with the "
                            "parameter commit=<sha> (e.g. traingate ci --commit $(git rev-parse HEAD))")
    return str(commit).lower()


def checkout(repository: str, commit: str, root: Path) -> Path:
    """``root``/ci/<full sha>: a clean checkout of ``commit`` (reused when an earlier run made it)."""
    base = root / "ci"
    base.mkdir(parents=True, exist_ok=True)
    mirror = base / "repo.git"
    if not mirror.exists():
        _git("clone", "--bare", "--quiet", repository, str(mirror))
    else:
        _git("fetch", "--quiet", "--prune", repository, "+refs/heads/*:refs/heads/*", cwd=mirror)
    try:
        sha = _git("rev-parse", "--verify", f"{commit}^{{commit}}", cwd=mirror)
    except CheckoutError:
        raise CheckoutError(f"commit = {commit!r} is not in {repository}; push it, or pass a sha of that "
                            "repository") from None
    work = base / sha
    if (work / ".git").exists():
        if _git("rev-parse", "HEAD", cwd=work) == sha and not _git("status", "--porcelain", cwd=work):
            return work
        raise CheckoutError(f"{work} exists but is not a clean checkout of {sha}; remove it and run again")
    _git("clone", "--quiet", "--no-checkout", str(mirror), str(work))
    _git("checkout", "--quiet", "--detach", sha, cwd=work)
    return work


def main() -> int:
    try:
        flow_run_id = os.environ.get("PREFECT__FLOW_RUN_ID")
        if not flow_run_id:
            raise CheckoutError("PREFECT__FLOW_RUN_ID is not set: this is the ci-canary deployment's pull step, "
                                "run by a worker for a flow run")
        repository = os.environ.get("TRAINGATE_CI_REPOSITORY")
        if not repository:
            raise CheckoutError("TRAINGATE_CI_REPOSITORY is not set: set it in the environment of the pool's worker "
                                "(a git URL or path the worker can clone)")
        state = os.environ.get("TRAINGATE_STATE_DIR")
        if not state or not Path(state).is_absolute():
            raise CheckoutError(f"TRAINGATE_STATE_DIR = {state!r}: the checkout goes under the pool's state directory; "
                                "set the pool's locations with `traingate pools bootstrap`")
        print(checkout(repository, requested_commit(flow_run_id), Path(state)))
    except CheckoutError as e:
        print(f"ci checkout: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
