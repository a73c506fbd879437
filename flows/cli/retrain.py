"""`traingate retrain SPEC [--set k=v ...]`: the retrain flow here (the `digits-nightly-retrain` deployment
runs it on a schedule): the ladder on the newest snapshot of ``data.uri`` (``{latest}``), then the new
model takes ``@champion`` only if it beats the champion by ``promotion.margin``; skipped when the data
did not change since the champion's. Exit 0 when it completed (promoted, not promoted or skipped),
1 when it stopped (a gate, a failure), 2 on a bad spec."""

from __future__ import annotations

import argparse

from flows.cli.run import _claimed_run, guard_this_process, interrupted
from flows.retrain import retrain
from traingate.ladder.preflight import check_spec, preflight
from traingate.settings import Settings
from traingate.snapshots import resolve_spec
from traingate.spec import load_spec


def main(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec, args.overrides)
    resolved = resolve_spec(spec)  # a bad spec or no snapshot: one line, exit 2, nothing started
    check_spec(resolved)
    preflight(resolved, Settings.from_env())
    Settings.from_env().ensure()
    guard_this_process(spec.supervision.preempt_grace_s)

    try:
        state = retrain(spec, return_state=True)  # resolves again: a snapshot published meanwhile is taken
    except KeyboardInterrupt:
        return interrupted(_claimed_run(Settings.from_env()))
    print(f"retrain {'COMPLETED' if state.is_completed() else 'STOPPED'}: {state.message}")
    return 0 if state.is_completed() else 1
