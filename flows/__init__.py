"""Prefect flows. Thin: they read like the pipeline diagram."""
