"""Search algorithms (Optuna samplers) and trial schedulers (Optuna pruners), from the spec.

    sampler  grid | random | tpe | cmaes | nsga2          what to try next
    scheduler fifo | median | asha | hyperband | pbt       how many steps a trial gets

PBT is not a pruner: the sweep driver runs it in generations (see ``traingate.sweep.pbt``);
here it maps to the no-op pruner.
"""

from __future__ import annotations

import optuna

from traingate.sweep.space import grid
from traingate.sweepspec import SweepSpec


class _AskTellGrid(optuna.samplers.GridSampler):
    """GridSampler ends ``study.optimize`` with ``study.stop()`` when the grid is used up, which raises
    outside optimize; with ask-and-tell the driver checks ``is_exhausted`` before asking instead."""

    def after_trial(self, study, trial, state, values) -> None:  # noqa: ANN001 - optuna's signature
        return None


def make_sampler(sweep: SweepSpec) -> optuna.samplers.BaseSampler:
    s, seed = sweep.sampler, sweep.seed
    if s == "grid":
        return _AskTellGrid(grid(sweep.space), seed=seed)
    if s == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if s == "tpe":
        conditional = any(p.when for p in sweep.space.values())
        # constant_liar: trials running in parallel are not all sampled at the same point.
        return optuna.samplers.TPESampler(
            seed=seed,
            multivariate=True,
            group=conditional,
            constant_liar=sweep.max_concurrent > 1,
            n_startup_trials=min(10, max(2, sweep.n_trials // 3)),
        )
    if s == "cmaes":
        return optuna.samplers.CmaEsSampler(
            seed=seed, warn_independent_sampling=False, n_startup_trials=min(5, max(1, sweep.n_trials // 4))
        )
    if s == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=sweep.population_size)
    raise AssertionError(f"unhandled sampler {s!r}")


def make_pruner(sweep: SweepSpec, max_steps: int) -> optuna.pruners.BasePruner:
    sc = sweep.scheduler
    min_r = sc.min_resource or sc.report_every
    if sc.name in ("fifo", "pbt"):
        return optuna.pruners.NopPruner()
    if sc.name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=sc.startup_trials, n_warmup_steps=sc.warmup_steps)
    if sc.name == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=min_r, reduction_factor=sc.reduction_factor)
    if sc.name == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=min_r, max_resource=max_steps, reduction_factor=sc.reduction_factor
        )
    raise AssertionError(f"unhandled scheduler {sc.name!r}")
