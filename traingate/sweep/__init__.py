"""Hyperparameter sweeps: plain functions and classes, no Prefect. The `sweep:` spec section is
:mod:`traingate.sweepspec` (pydantic only; every training process imports it with the RunSpec).

space      search space -> Optuna suggestions (incl. conditional params); a point -> a RunSpec
algorithms samplers (grid, random, tpe, cmaes, nsga2) and schedulers (fifo, median, asha, hyperband)
study      the Optuna RDB study with heartbeats; stale trials re-queued with their trial key
driver     the ask-and-tell loop: concurrency, budgets, tell
report     progress.jsonl -> trial.report / should_prune; objective values
pbt        population-based training: exploit/explore plan, checkpoint copy
results    ranking, reproducibility verdict
tracking   MLflow parent/child runs;  plots: Optuna's matplotlib figures
inprocess  a stage trained in this process (the benchmark);  fence: stop orphaned trainers
"""
