"""Every command's arguments, one function per command (named as it): cheap to import, so `--help` and a
refused argument never import a command's module (some import Prefect, MLflow or torch: seconds)."""

from __future__ import annotations

import argparse
import os

from traingate.job.vocab import DEFAULT_KINDS, DRILL_KINDS
from traingate.settings import IMAGE_VAR, SECRET_BLOCKS_VAR
from traingate.spec import STAGES

DEPLOYMENT = "pipeline/ci-canary"  # `traingate ci --commit`'s default deployment


def set_argument(p: argparse.ArgumentParser, help: str, *, empty_default: bool = True) -> None:
    """``--set KEY=VALUE`` (repeatable) into ``overrides``: every command that takes spec overrides."""
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[] if empty_default else None,
        metavar="KEY=VALUE",
        help=help,
    )


def spec_arguments(p: argparse.ArgumentParser) -> None:
    """SPEC and --set, as `validate` and `run` take them."""
    p.add_argument("spec", help="RunSpec YAML file")
    set_argument(p, "override a spec field, e.g. --set optim.lr=0.001 (repeatable)")


def verbose(p: argparse.ArgumentParser) -> None:
    """``-v``, every command's: what goes to the log file is shown on the terminal too (flows.cli.console)."""
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also show library log lines, warnings and download bars (they always go to the log file)",
    )


def validate(p: argparse.ArgumentParser) -> None:
    spec_arguments(p)
    p.add_argument(
        "--pools",
        metavar="CONFIG",
        default=None,
        help="pools config YAML whose priority classes resources.priority is checked against (default: the built-in "
        "urgent, production, research)",
    )


def run(p: argparse.ArgumentParser) -> None:
    spec_arguments(p)
    p.add_argument("--until", choices=STAGES, default="full", help="last stage to run")
    p.add_argument("--dry-run", action="store_true", help="print the plan and estimated cost; run nothing")


def resume(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_id", help="the traingate run id (printed by `traingate run`)")
    p.add_argument("--until", choices=STAGES, default="full", help="last stage to run (default: full)")
    p.add_argument(
        "--stage", choices=STAGES, default=None, help="stage to resume (default: the run's first unfinished stage)"
    )
    set_argument(
        p,
        "change the spec for the rest of the run, e.g. --set budget.max_run_usd=20 after a "
        "budget pause (repeatable; a checkpoint refuses changes its state depends on)",
    )


def drill(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="RunSpec YAML file")
    set_argument(p, "override a spec field, e.g. --set supervision.hang_timeout_s=10 (repeatable)")
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


def sweep(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="RunSpec YAML file with a `sweep:` section")
    set_argument(p, "override a spec field, e.g. --set sweep.n_trials=20 (repeatable)")
    p.add_argument(
        "--promote",
        action="store_true",
        help="run the best configuration up the ladder (to sweep.promotion.until, default full)",
    )


def runs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experiment", help="only this MLflow experiment")
    p.add_argument("--team", help="only runs of this team")
    p.add_argument(
        "--sort",
        metavar="METRIC",
        help="order by a metric of each run's deepest stage, e.g. val_accuracy (highest first)",
    )
    p.add_argument("--asc", action="store_true", help="with --sort: lowest first")
    p.add_argument("--limit", type=int, default=50, help="at most this many rows (default 50)")


def show(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_id", help="a pipeline run id (or a stage run id: its pipeline is shown)")


def watch(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_id", help="the traingate run id (`traingate run` printed it; `traingate runs` lists them)")
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between redraws (default 1)")
    p.add_argument("--once", action="store_true", help="draw the run once and exit (scripts, a quick look)")


def note(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_id", help="the run (pipeline or stage) the note is about")
    p.add_argument("text", help='what happened and why, e.g. "lowered the LR: loss spikes after step 2k"')
    p.add_argument("--author", default=None, help="who writes it (default: the current user)")


def replay(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "target",
        metavar="RUN_ID_OR_STAGE_DIR",
        help="a traingate run id (its directory under the state dir), a run directory or a stage directory",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to keep trying an unreachable tracking store before giving up (default 60)",
    )


def pools(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    b = sub.add_parser("bootstrap", help="create/update work pools, queues, slot and quota limits from a config")
    b.add_argument("config", help="pools config YAML, e.g. examples/pools.yaml")
    b.add_argument(
        "--image",
        default=os.environ.get(IMAGE_VAR),
        help=f"training image of docker/kubernetes pools (default: ${IMAGE_VAR})",
    )
    show = sub.add_parser("show", help="each pool's nodes (a Slurm pool's from sinfo: state, GPUs used, drain reason)")
    show.add_argument("config", help="pools config YAML")
    show.add_argument("--pool", help="only this pool")
    drain = sub.add_parser("drain", help="take a Slurm node out of service (scontrol ... state=drain)")
    drain.add_argument("node", help="the Slurm node name, e.g. n1")
    drain.add_argument("--reason", required=True, help="why (recorded as traingate:REASON on the node)")
    back = sub.add_parser("resume", help="return a drained Slurm node to service (scontrol ... state=resume)")
    back.add_argument("node", help="the Slurm node name")
    sub.add_parser(
        "secrets",
        help=f"store the credentials ${SECRET_BLOCKS_VAR} names as Prefect Secret blocks, "
        "each from the variable of the same name in this environment",
    )


def queue(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pool", help="only this pool")


def simulate(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "trace", help="CSV: job_id,submit_s,duration_s,gpus[,team,priority,pool|pools|gpu_types,est_duration_s]"
    )
    p.add_argument("--pools", required=True, metavar="CONFIG", help="pools config YAML, e.g. examples/pools.yaml")
    p.add_argument(
        "--policies",
        help="comma-separated ORDER[+aged][+backfill][+preempt]; ORDER is fifo, priority, sjf, fairshare, "
        "multifactor (Slurm's multifactor priority) or hrrn (highest response ratio next); +aged: "
        "scheduling.starvation_bound_h ranks the long-waiting first (default: the ten-way comparison and the "
        "config's default policy)",
    )
    p.add_argument("--pool", help="pool of trace rows without a pool column (needed when the config has several)")
    p.add_argument(
        "--half-life-h", type=float, help="fair-share half-life (default: the config's scheduling.half_life_h)"
    )
    p.add_argument(
        "--placement",
        help="where jobs go on a pool whose trace jobs ask fractions of a GPU (shared GPUs): bestfit or fgd "
        "(default: the config's simulator.placement)",
    )
    p.add_argument("--out", help="output directory (default: <state dir>/simulate/<trace name>)")
    g = p.add_argument_group("generate a trace first (into TRACE.csv, which must not exist)")
    g.add_argument(
        "--generate", type=int, metavar="N", help="N jobs shaped by published cluster traces (see docs/simulator.md)"
    )
    g.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--load",
        type=float,
        help="offered GPU time / the pools' GPU time: a generated trace is drawn at it (default 0.8), a trace "
        "read from a file has its arrivals compressed or stretched to it (default: as recorded)",
    )
    f = p.add_argument_group("instead of the replay: the fill experiment (shared GPUs, placement policies)")
    f.add_argument(
        "--fill",
        action="store_true",
        help="jobs sampled from the trace (gpus may be a fraction of one GPU) arrive and stay until their demand "
        "reaches each pool's capacity; report the unallocated and fragmented GPU share at each fill level",
    )
    f.add_argument("--placements", help="comma-separated: bestfit, fgd (default: both, compared)")
    f.add_argument("--fill-runs", type=int, default=5, help="samples per placement, seeds --seed.. (default 5)")


def ci(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", help="spec file: run its cheap stages here (default up to canary)")
    p.add_argument(
        "--summary", metavar="FILE", help="append a markdown summary here (default: $GITHUB_STEP_SUMMARY when set)"
    )
    p.add_argument(
        "--commit",
        help="instead: run the ci-canary deployment on this commit (a sha of the "
        "repository the pool's worker clones: TRAINGATE_CI_REPOSITORY)",
    )
    p.add_argument("--deployment", default=DEPLOYMENT, help=f"default {DEPLOYMENT}")
    p.add_argument(
        "--spec", dest="spec_path", help="with --commit: spec file inside the commit (default: the deployment's)"
    )
    set_argument(p, "override a spec field (repeatable)", empty_default=False)
    p.add_argument(
        "--until", choices=STAGES, help="last stage (default: canary for a spec file, the deployment's for --commit)"
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the run (default 3600)")


def cost(p: argparse.ArgumentParser) -> None:
    p.add_argument("--team", help="only runs of this team")
    p.add_argument("--experiment", help="only this experiment (MLflow experiment name)")
    p.add_argument("--since", metavar="AGE", help="only runs started within this age, e.g. 7d, 12h, 30m")
    p.add_argument("--run", metavar="RUN_ID", help="only this run (a RUN ID `traingate runs` lists)")


def retrain(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="RunSpec YAML file (data.uri may name the version {latest})")
    set_argument(p, "override a spec field, e.g. --set promotion.margin=0.01 (repeatable)")


def server(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action",
        choices=("start", "status", "stop"),
        help="start the local Prefect server traingate keeps (run, resume, sweep and retrain use it when "
        "PREFECT_API_URL is unset), say whether it runs and where, or stop it",
    )
