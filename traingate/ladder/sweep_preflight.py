"""Everything a sweep must pass before anything starts."""

from __future__ import annotations

from traingate.ladder.preflight import check_spec, preflight
from traingate.settings import Settings
from traingate.spec import RunSpec, SpecError
from traingate.sweep.space import check_space
from traingate.sweepspec import SchedulerSpec, SweepSpec


def check_sweep(spec: RunSpec) -> SweepSpec:
    """Validate a sweep (SpecError: one line naming field, value and fix); returns its section."""
    sw = spec.sweep
    if sw is None:
        raise SpecError("sweep: the spec has no `sweep:` section; add one (see docs/sweeps.md)")
    if sw.scheduler.name == "pbt":
        # Refused rather than run like fifo: a PBT sweep that silently is not one wastes its budget.
        raise SpecError(
            "sweep.scheduler.name = 'pbt': the sweep flow does not run PBT generations (members as "
            "trial subflows); run traingate.sweep.pbt.run_generations in-process, or use asha/hyperband"
        )
    defaults = SchedulerSpec()
    for name in ("pbt_interval", "pbt_quantile", "pbt_perturb"):
        # Only PBT reads them, and the flow runs no PBT: a value set here would do nothing.
        if getattr(sw.scheduler, name) != getattr(defaults, name):
            raise SpecError(
                f"sweep.scheduler.{name} = {getattr(sw.scheduler, name)!r}: only PBT reads it, and the sweep "
                "flow does not run PBT generations; remove it"
            )
    check_spec(spec)
    check_space(spec)
    preflight(spec, Settings.from_env())
    return sw
