"""`traingate drill SPEC [--set k=v ...] [--faults N] [--kinds kill,term,stop,io] [--seed S]`.

Trains the stage undisturbed, then again while killing random ranks at random steps,
sending SIGTERM, stalling a rank (SIGSTOP) and failing the checkpoint store; passes
when the disturbed run recovers every time and ends with bitwise-equal weights.
Runs the supervisor directly (no Prefect flow): a drill tests the runtime and the
supervision policy, and leaves the team's Prefect history alone.
"""

from __future__ import annotations

import argparse
import json
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    from traingate.supervision.drill import DEFAULT_KINDS, DRILL_KINDS

    p.add_argument("spec", help="RunSpec YAML file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a spec field, e.g. --set supervision.hang_timeout_s=10 (repeatable)",
    )
    p.add_argument("--stage", choices=["canary", "full"], default="full", help="stage to drill (default full)")
    p.add_argument("--faults", type=int, default=5, help="number of faults to inject (default 5)")
    p.add_argument(
        "--kinds",
        default=",".join(DEFAULT_KINDS),
        help=f"comma-separated fault kinds out of {','.join(DRILL_KINDS)}, cycled through "
        f"(default {','.join(DEFAULT_KINDS)})",
    )
    p.add_argument("--seed", type=int, default=None, help="fault plan seed (default: random, printed)")
    p.add_argument("--json", dest="json_path", default=None, help="also write the report as JSON here")


def main(args: argparse.Namespace) -> int:
    import dataclasses
    import random
    from pathlib import Path

    from traingate.ladder.preflight import check_spec, preflight
    from traingate.settings import Settings
    from traingate.snapshots import resolve_spec
    from traingate.spec import load_spec
    from traingate.supervision.drill import plan, run_drill
    from traingate.supervision.supervisor import Hooks

    spec = resolve_spec(load_spec(args.spec, args.overrides))  # data.uri's {latest}: the version of now
    check_spec(spec)
    settings = Settings.from_env()
    preflight(spec, settings)
    settings.ensure()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    limits = getattr(spec.stages, args.stage)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    try:
        faults = plan(
            kinds,
            args.faults,
            limits.max_steps,
            spec.world_size if args.stage == "full" else spec.resources.procs_per_node,
            seed,
            spec.checkpoint.every_steps,
        )
    except ValueError as e:
        print(f"traingate drill: {e}")
        return 2
    work = settings.state_dir / "drills" / time.strftime("%Y%m%d-%H%M%S")
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
