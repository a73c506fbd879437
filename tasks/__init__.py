"""Prefect tasks. Each wraps ONE side-effect boundary; the logic they call lives in traingate/."""
