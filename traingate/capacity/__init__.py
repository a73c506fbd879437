"""Shared GPU capacity: who runs next on a pool, as pure functions over plain data.

- :mod:`traingate.capacity.pools`     — the capacity config: pools (node classes), priority classes,
  team quotas, scheduling defaults (``examples/pools.yaml``).
- :mod:`traingate.capacity.jobs`      — ``Job``: what the scheduler knows about one attempt.
- :mod:`traingate.capacity.gang`      — nodes and slots: all-or-nothing placement, fragmentation.
- :mod:`traingate.capacity.fairshare` — decayed GPU-hours per team (the fair-share formula).
- :mod:`traingate.capacity.estimate`  — predicted durations from history, never the true one.
- :mod:`traingate.capacity.policy`    — one scheduling pass: order, quotas, backfill, preemption.
- :mod:`traingate.capacity.simulate`  — a discrete-event replay of a trace through ``policy``.
- :mod:`traingate.capacity.trace`     — trace CSV reader/writer and a generator from published
  cluster characterisations.
- :mod:`traingate.capacity.report`    — the comparison table and plots.
- :mod:`traingate.capacity.slurm`     — the Slurm engine's mapping: sbatch options of a StageJob,
  squeue/sinfo/sacct JSON, job states to endings, sbatch refusals in one line.
- :mod:`traingate.capacity.slurm_cli` — the Slurm commands, run; an unanswering controller is retryable.

The orchestrator (Prefect work queues and global concurrency limits) carries out what
:func:`traingate.capacity.policy.schedule` decides; the simulator calls the same function.
"""
