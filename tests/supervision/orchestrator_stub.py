"""An orchestrator for the write-ahead tests: supervises one stage the way `traingate run` does (a guardian
that stops the tree if this process dies; the supervisor's launch path), so a test can SIGKILL it at a
chosen moment. ``python orchestrator_stub.py SPEC.yaml RUN_DIR STAGE GRACE_S``."""

from __future__ import annotations

import sys
from pathlib import Path


def main(spec_path: str, run_dir: str, stage: str, grace_s: str) -> None:
    from traingate.job.stagejob import derive
    from traingate.settings import Settings
    from traingate.spec import load_spec
    from traingate.supervision import guardian
    from traingate.supervision.supervisor import Hooks, supervise

    guardian.ensure(float(grace_s))
    run = Path(run_dir)
    job = derive(load_spec(spec_path), stage, run_id=run.name, run_dir=run, settings=Settings.from_env())
    supervise(job, Hooks(info=lambda line: print(line, flush=True)), seed=0)


if __name__ == "__main__":
    main(*sys.argv[1:])
