"""`traingate replay RUN_ID_OR_STAGE_DIR`: deliver what a lost tracking store missed.

While the tracking store is gone, a run keeps its records in journals: each stage's
(``<stage dir>/tracking/journal.jsonl``, written by rank 0) and the run's own
(``<run dir>/tracking/journal.jsonl``: the orchestrator's writes after each stage). This
delivers them, stage journals first (a stage's record reads its metric history for the
plots), then the orchestrator's writes in the order they were kept. Delivered records are
marked as such, so running it again delivers nothing twice.
"""

from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path

from traingate.job.files import JOB
from traingate.ladder import replay
from traingate.promotion.refusal import refusal
from traingate.redact import redact
from traingate.settings import Settings
from traingate.spec import STAGES
from traingate.tracking import journal, runs, stale


def _resolve(target: str, settings: Settings) -> tuple[Path, list[Path], bool] | None:
    """(run dir, stage dirs to deliver, whether the run's own writes too) for a run id or directory."""
    path = Path(target)
    if path.is_dir() and (path / JOB).is_file():
        return path.parent, [path], False  # one stage: its journal only
    run_dir = path if path.is_dir() else settings.state_dir / "runs" / target
    if "/" in target and not path.is_dir() or not run_dir.is_dir():
        return None
    order = {s: i for i, s in enumerate(STAGES)}
    stages = sorted((d for d in run_dir.iterdir() if (d / JOB).is_file()), key=lambda d: order.get(d.name, 99))
    return run_dir, stages, True


def main(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    where = _resolve(args.target, settings)
    if where is None:
        print(
            f"traingate replay: no run {args.target!r} under {settings.state_dir / 'runs'} and no such stage or "
            "run directory; pass the run id `traingate run` printed, or a stage directory"
        )
        return 2
    run_dir, stage_dirs, whole_run = where
    o = stale.read_orchestrator(run_dir)
    if o is not None and o.host == socket.gethostname() and stale.gone(o) is None:
        print(
            f"traingate replay: run {run_dir.name} is still running (orchestrator pid {o.pid}); its processes "
            "deliver their own records: replay after it ends"
        )
        return 2
    uri = redact(settings.tracking_uri)
    delivered = 0
    for stage_dir in stage_dirs:
        size = journal.pending_bytes(journal.journal_path(stage_dir))
        if not size:
            continue
        try:
            left = replay.replay_stage(settings.tracking_uri, stage_dir, args.timeout)
        except (ValueError, RuntimeError) as e:  # no stage run to deliver into; the store refused records
            print(f"traingate replay: {stage_dir.name}: {redact(str(e)).splitlines()[0]}")
            return 1
        if left:
            print(
                f"traingate replay: tracking store {uri} still unreachable after {args.timeout:.0f} s: "
                f"{left / 1024:.1f} KiB of {stage_dir.name}'s records stay in {journal.journal_path(stage_dir)}; "
                "run this again when it is back"
            )
            return 1
        delivered += 1
        print(f"{stage_dir.name}: delivered {size / 1024:.1f} KiB of records")
    if whole_run:
        deadline = time.monotonic() + args.timeout
        while True:
            try:
                made = replay.replay_calls(runs.client(settings.tracking_uri), run_dir)
                break
            except Exception as e:  # noqa: BLE001 - re-raised unless the store is unreachable
                if not runs.store_unreachable(e):
                    raise
                if time.monotonic() >= deadline:
                    print(
                        f"traingate replay: tracking store {uri} still unreachable after {args.timeout:.0f} s "
                        f"({redact(str(e)).splitlines()[0][:160]}); the run's kept writes stay in "
                        f"{journal.journal_path(run_dir)}; run this again when it is back"
                    )
                    return 1
                time.sleep(2.0)
        for call, result in made:
            delivered += 1
            line = f"{call.replace('_', '-')}: made"
            if isinstance(result, dict) and result.get("registered"):
                line += f": models:/{result['name']}@{result['alias']} (version {result['version']})"
            elif isinstance(result, dict):
                line += f": {redact(refusal(result.get('reasons', [])))}"
            print(line)
    print(
        f"run {run_dir.name}: {'nothing left to deliver' if delivered else 'nothing to deliver'} (tracking store {uri})"
    )
    return 0
