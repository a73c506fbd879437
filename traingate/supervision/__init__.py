"""Supervision: how a training stage survives faults. Plain policy, no Prefect.

- :mod:`causes`    classify how a process tree ended (exit codes, signals, last words)
- :mod:`backoff`   exponential backoff with jitter, and the per-run retry budget
- :mod:`heartbeat` hang detection from per-rank heartbeats; checkpoint-staleness alert
- :mod:`oom`       the opt-in OOM policy (half the micro-batch, double the accumulation)
- :mod:`inject`    fault injection inside the training process, for tests and drills
- :mod:`supervisor` the restart loop around one torchrun process tree
- :mod:`drill`     fault-injection drills and their report
"""
