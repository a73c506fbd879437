"""Prefect's private API: the only place traingate reaches past Prefect's public surface.

Written against ``prefect==3.8.8`` (the pin in pyproject.toml); ``tests/test_compat.py`` fails
when the installed version or the behaviour relied on here changes, so a version bump is
re-checked here and nowhere else.

Why at all: the public ``prefect.concurrency.sync.concurrency`` context manager hides the lease
id of the slots it holds. A sweep stores the lease ids on its Optuna trial, so whoever re-queues
a trial whose driver died releases that trial's slots at once instead of waiting out the lease.
What is relied on:

- ``acquire_concurrency_slots_with_lease(names, slots, lease_duration=, strict=)`` takes ``slots``
  of each named global limit at once and returns a response whose ``lease_id`` names the holding;
  ``strict``: a missing limit raises ``ConcurrencySlotAcquisitionError`` instead of a warning and
  no limit at all; the server refuses a ``lease_duration`` under 60 s;
- ``release_concurrency_slots_with_lease(lease_id)`` gives them back, accepts the id as a string
  (as stored on a trial), and is a no-op for a lease that is already gone (released, or expired
  and reclaimed by the server);
- ``maintain_concurrency_lease(lease_id, lease_duration, raise_on_lease_renewal_failure=)`` renews
  the lease from a thread for as long as the block runs.
"""

from __future__ import annotations

from prefect.concurrency._leases import maintain_concurrency_lease
from prefect.concurrency._sync import acquire_concurrency_slots_with_lease, release_concurrency_slots_with_lease

PINNED = "3.8.8"

__all__ = [
    "PINNED",
    "acquire_concurrency_slots_with_lease",
    "maintain_concurrency_lease",
    "release_concurrency_slots_with_lease",
]
