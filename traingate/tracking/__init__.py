"""All MLflow use lives here: run identity, the rank-0 writer, resume-same-run."""
