"""Why a run whose stages all passed was not promoted, said once, with what to change.

The checks (:func:`traingate.tracking.runs.can_promote`, :func:`traingate.promotion.register.register_candidate`)
list every problem as found, on the full stage's run and again on its pipeline run: a missing data
snapshot shows up as four findings. A person needs one line: what is missing and the setting that fixes it.

>>> refusal(["identity incomplete: traingate.data_snapshot", "identity incomplete: traingate.data_uri",
...          "pipeline run identity incomplete: traingate.data_snapshot",
...          "pipeline run identity incomplete: traingate.data_uri"])
... # doctest: +NORMALIZE_WHITESPACE
'not promoted: no data snapshot - set data.uri (the file or directory the script trains on;
 its content hash is the snapshot)'
>>> refusal(["its gate did not pass"])
'not promoted: its gate did not pass'
"""

from __future__ import annotations

from collections.abc import Sequence

# The prefixes can_promote puts before an identity problem of the stage run and of its pipeline run.
_IDENTITY_PREFIXES = ("pipeline run identity incomplete: ", "identity incomplete: ")

_DATA = (
    "no data snapshot",
    "set data.uri (the file or directory the script trains on; its content hash is the snapshot)",
)
_CODE = (
    "no code version",
    "run from a git checkout, or from a build stamped with its version (traingate.tracking.stamp)",
)
# Each identity field a run may lack: what that means, and what to change so the next run has it.
_FIXES: dict[str, tuple[str, str]] = {
    "traingate.data_snapshot": _DATA,
    "traingate.data_uri": _DATA,
    "traingate.code_version": _CODE,
    "traingate.code_dirty": _CODE,
    "traingate.code_diff_hash": ("uncommitted changes without a diff hash", "commit the changes and run again"),
    "traingate.owner": ("no owner", "set identity.owner"),
    "traingate.team": ("no team", "set identity.team"),
    "traingate.purpose": ("no purpose", "set identity.purpose"),
    "traingate.experiment": ("no experiment", "set identity.experiment"),
}
_RECORD_FIX = "run it again: its MLflow record was not completely written"


def refusal(reasons: Sequence[str]) -> str:
    """One line: ``not promoted:`` and each distinct problem once, with its fix where there is one."""
    seen: dict[str, str] = {}
    for reason in reasons:
        problem = next((reason[len(p) :] for p in _IDENTITY_PREFIXES if reason.startswith(p)), None)
        if problem is None:
            seen.setdefault(reason, reason)
            continue
        what, fix = _FIXES.get(problem, (f"run record lacks {problem}", _RECORD_FIX))
        seen.setdefault(what, f"{what} - {fix}")
    return "not promoted: " + ("; ".join(seen.values()) or "no reason recorded")
