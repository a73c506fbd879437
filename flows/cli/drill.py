"""`traingate drill SPEC [--set k=v ...] [--faults N] [--kinds kill,term,stop,io] [--seed S]`.

Trains the stage undisturbed, then again while killing random ranks at random steps,
sending SIGTERM, stalling a rank (SIGSTOP) and failing the checkpoint store; passes
when the disturbed run recovers every time and ends with bitwise-equal weights.
Runs the supervisor directly (no Prefect flow): a drill tests the runtime and the
supervision policy, and leaves the team's Prefect history alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path

from traingate.job.stagejob import JobKind, derive
from traingate.ladder.preflight import check_spec, preflight
from traingate.settings import Settings
from traingate.snapshots import resolve_spec
from traingate.spec import load_spec
from traingate.supervision.drill import plan, run_drill
from traingate.supervision.supervisor import Hooks


def main(args: argparse.Namespace) -> int:
    spec = resolve_spec(load_spec(args.spec, args.overrides))  # data.uri's {latest}: the version of now
    check_spec(spec)
    settings = Settings.from_env()
    preflight(spec, settings)
    settings.ensure()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    work = settings.state_dir / "drills" / time.strftime("%Y%m%d-%H%M%S")
    # The faults fit the stage's own StageJob: its steps, its world size, its checkpoint interval.
    job = derive(spec, args.stage, run_id="drill", run_dir=work, settings=settings, kind=JobKind.DRILL)
    try:
        faults = plan(kinds, args.faults, job.max_steps, job.world_size, seed, job.checkpoint_every_steps)
    except ValueError as e:
        print(f"traingate drill: {e}")
        return 2
    print(f"drill: seed {seed}, faults {', '.join(f.token for f in faults)}; work dir {work}", flush=True)
    report = run_drill(spec, args.stage, faults, Path(work), Hooks(info=lambda m: print(m, flush=True)), settings)
    print()
    print(report.render())
    if args.json_path:
        data = dataclasses.asdict(report) | {
            "time_lost_s": report.time_lost_s,
            "goodput": report.goodput,
            "passed": report.passed,
            "seed": seed,
        }
        Path(args.json_path).write_text(json.dumps(data, indent=1))
    return 0 if report.passed else 1
