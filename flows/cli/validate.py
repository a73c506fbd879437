"""`traingate validate SPEC`: the spec fully resolved, or one line saying what is wrong.

Offline: it opens no connection (no store is listed, no remote data read); ``${env:NAME}`` references are
checked against the allowlist and the environment in memory and printed as references.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import yaml

from traingate.capacity import entitlements
from traingate.capacity.pools import BUILTIN_CLASSES, load_config, priority_class
from traingate.ladder.preflight import check_spec, preflight, remote_data
from traingate.secrets import extract
from traingate.settings import Settings
from traingate.snapshots import resolve_spec
from traingate.spec import load_spec, parse_spec


def _load(args: argparse.Namespace) -> tuple[Any, dict[str, int]]:
    spec = load_spec(args.spec, args.overrides)
    if args.cmd != "run":
        # `validate` sends nothing anywhere: a remote store is not listed, remote data is not read.
        config = load_config(args.pools) if args.pools else None
        priority_class(config, spec.resources.priority, args.pools or BUILTIN_CLASSES)
        # The pools file's entitlements for the OS user running this (a stage's width is checked at admission).
        entitlements.check(
            config, entitlements.os_user(), spec.identity.team, spec.resources.priority, spec.resources.work_pool, 0
        )
        spec = spec if remote_data(spec) else resolve_spec(spec)  # a local {latest} is listed on this disk
        return spec, check_spec(spec, offline=True)
    if not os.environ.get("PREFECT_API_URL"):
        # A temporary server carries no pools config: the built-in classes. A server's config is read before the
        # flow run (flows.pipeline.check_entitled).
        priority_class(None, spec.resources.priority, BUILTIN_CLASSES)
    # data.uri's {latest} is resolved once, here: the ladder and every stage read that same version.
    spec = resolve_spec(spec)
    samples = check_spec(spec)
    # Every store the run will use answers before anything is created.
    preflight(spec, Settings.from_env())
    return spec, samples


def main(args: argparse.Namespace) -> int:
    spec, _ = _load(args)
    # Printed as `run` records it: each literal secret a ${env:TRAINGATE_SECRET_<n>} reference.
    tree, _, _ = extract(spec.to_dict())
    print(yaml.safe_dump(tree, sort_keys=False), end="")
    print(f"# spec ok: hash {parse_spec(tree).spec_hash()}", file=sys.stderr)
    return 0
