"""Supervision: how a training stage survives faults. Plain policy, no Prefect. Runs in the
orchestrator, never inside a training process (their half lives in :mod:`traingate.runtime`).

- :mod:`causes`    classify how a process tree ended (exit codes, signals, last words)
- :mod:`backoff`   exponential backoff with jitter, and the per-run retry budget
- :mod:`heartbeat` hang detection from per-rank heartbeats; checkpoint-staleness alert
- :mod:`oom`       the opt-in OOM policy (half the micro-batch, double the accumulation)
- :mod:`supervisor` the restart loop around one StageJob's process tree: the one launch path
- :mod:`drivers`   what differs between a built-in recipe and a user's script, behind one interface
- :mod:`watch`     what the loop does every tick while a launch runs (heartbeats or output, hangs)
- :mod:`alerting`  the alert rules' actions on a running stage (pause, stop, roll back, quarantine)
- :mod:`attempts`  the records: Hooks in, Supervision out, one Attempt per launch, supervisor.json
- :mod:`checkpoints` the newest checkpoint of a stage, and a full disk as a verdict
- :mod:`drill`     fault-injection drills and their report
- :mod:`slurm_result` after a Slurm job ended: the supervisor's verdict, a resubmission, or what Slurm did
"""
