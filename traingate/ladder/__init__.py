"""The ladder: its plan and gates, the checks before anything starts, one stage's supervised run (in the
launch task, or as a Slurm job's batch step), what ended an attempt, and the replay of lost records."""
