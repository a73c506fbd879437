"""The process boundary: what the orchestrator hands a training process, and what it hands back.

- :mod:`traingate.job.stagejob` — ``StageJob``, every fact of one attempt of one stage, derived once.
- :mod:`traingate.job.envvars`  — every environment variable the platform sets, writer beside reader.
- :mod:`traingate.job.files`    — the stage directory's files (result, heartbeats, last words,
  progress, supervisor state), one typed reader/writer each, atomic writes.
- :mod:`traingate.job.vocab`    — stage status and failure cause as enums.
- :mod:`traingate.job.result`   — ``StageResult`` and ``GateDecision``: what every stage ends in, what a gate reads.
- :mod:`traingate.job.catalog`  — the checkpoints a stage left, read from their manifests without torch.
- :mod:`traingate.job.sizing`   — a stage's billable slots, and its wall time and cost from a measured profile.

Both sides import this package; it imports neither side.
"""
