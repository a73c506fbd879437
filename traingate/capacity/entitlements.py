"""Who may ask the local engine for what: the pools file's ``entitlements`` read for one OS user.

The member is the OS user running traingate (the pool's authority reads it from its socket's peer
credentials); the team a job charges must be one of that user's teams, or a team the file does not
list (which gets the default classes and quota). A spec asking for more is refused in one line naming
the field, the value and what is allowed.

>>> from traingate.capacity.pools import parse_config
>>> cfg = parse_config({"pools": {"p": {"gpus_per_node": 2, "nodes": 1, "price_per_gpu_hour": 1.0,
...                                     "worker": "process"}},
...                     "entitlements": {"default": {"classes": ["research"], "quota": {"p": 1}},
...                                      "teams": {"vision": {"members": ["alice"], "classes": ["research", "urgent"],
...                                                           "quota": {"p": 2}}}}})
>>> problem(cfg, "alice", "vision", "urgent", "p", 2) is None
True
>>> problem(cfg, "eve", "vision", "research", "p", 1)
"identity.team = 'vision': OS user 'eve' is not a member of team vision (members: alice); use a team you belong \
to or ask an admin to add eve to entitlements.teams.vision.members"
>>> problem(cfg, "eve", "lab", "urgent", "p", 1)
"resources.priority = 'urgent': team lab may use research (entitlements.default.classes); use one of them"
>>> problem(cfg, "eve", "lab", "research", "p", 2)
"2 slots on pool 'p' exceed team lab's quota of 1 (entitlements.default.quota.p); lower resources.procs_per_node \
or resources.nodes"
"""

from __future__ import annotations

import os
import pwd

from traingate.capacity.gang import footprint
from traingate.capacity.pools import CapacityConfig, CapacityError, Engine


def os_user(uid: int | None = None) -> str:
    """The OS user name of ``uid`` (default: this process's effective user)."""
    u = os.geteuid() if uid is None else uid
    try:
        return pwd.getpwuid(u).pw_name
    except KeyError:  # a uid without a passwd entry (containers): its number is its name
        return str(u)


def problem(cfg: CapacityConfig, user: str, team: str, priority: str, pool: str, slots: int) -> str | None:
    """Why ``user`` may not run a job of ``slots`` for ``team`` in class ``priority`` on local ``pool``, or None.
    Without an ``entitlements`` section every user may use every class (a one-user machine)."""
    ent = cfg.entitlements
    if ent is None or pool not in cfg.pools or cfg.pools[pool].engine != Engine.LOCAL:
        return None
    listed = ent.teams.get(team)
    if listed is not None and user not in listed.members:
        members = ", ".join(listed.members) or "none"
        return (
            f"identity.team = {team!r}: OS user {user!r} is not a member of team {team} (members: {members}); "
            f"use a team you belong to or ask an admin to add {user} to entitlements.teams.{team}.members"
        )
    classes, where = (
        (listed.classes, f"entitlements.teams.{team}.classes")
        if listed is not None
        else (ent.default.classes, "entitlements.default.classes")
    )
    if priority not in classes:
        return f"resources.priority = {priority!r}: team {team} may use {', '.join(classes)} ({where}); use one of them"
    cap = cfg.quota_of(team, pool)
    need = footprint(slots, cfg.pools[pool].gpus_per_node)
    if cap is not None and need > cap:
        src = (
            f"entitlements.teams.{team}.quota.{pool}"
            if listed is not None and pool in listed.quota
            else f"quotas.{team}.{pool}"
            if pool in cfg.quotas.get(team, {})
            else f"entitlements.default.quota.{pool}"
        )
        return (
            f"{need} slots on pool {pool!r} exceed team {team}'s quota of {cap} ({src}); "
            f"lower resources.procs_per_node or resources.nodes"
        )
    return None


def check(cfg: CapacityConfig | None, user: str, team: str, priority: str, pool: str, slots: int) -> None:
    """:func:`problem` as a CapacityError (one line); nothing without a config."""
    why = None if cfg is None else problem(cfg, user, team, priority, pool, slots)
    if why is not None:
        raise CapacityError(why)
