"""The local engine's scheduling records, signed: what a pool's authority (:mod:`traingate.capacity.authority`)
writes and what every reader (the authority after a restart, ``traingate queue``) believes.

Each record is ``{"kind", "name", "value", "sig"}`` with ``sig`` = HMAC-SHA256 over the canonical JSON of the
other three, keyed by the pool's authority key: 32 random bytes made at the authority's first start in the
state directory (``authority/<pool>.key``, mode 0600, never in a spec, a flow parameter or a log). A record
whose signature is missing or wrong was not written by the authority: readers ignore it and report it.

>>> s = Signer(b"k" * 32)
>>> r = s.sign("entry", "r1-full", {"slots": 1})
>>> s.verify(r) is None
True
>>> s.verify({**r, "value": {"slots": 8}})
'entry r1-full: bad signature (not written by the pool authority); ignored'
>>> s.verify({"kind": "preempt", "name": "r1-full", "value": {"by": "x"}})
'preempt r1-full: no signature (not written by the pool authority); ignored'
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KEY_BYTES = 32
ENTRY = "entry"  # a job in the queue: its Entry (waiting or running, with its lease)
USAGE = "usage"  # a team's decayed GPU-hours on the pool: (usage, as of)
HISTORY = "history"  # held seconds of finished jobs of one experiment/stage/slots: (running mean, count)
PREEMPT = "preempt"  # the authority asked a running job to stop for another: {"by": job id}


def authority_dir(state_dir: str | Path) -> Path:
    """Where the pools' authorities keep their key, socket, lock, config and records (0700)."""
    d = Path(state_dir) / "authority"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


def key_path(state_dir: str | Path, pool: str) -> Path:
    return authority_dir(state_dir) / f"{pool}.key"


def records_path(state_dir: str | Path, pool: str) -> Path:
    return authority_dir(state_dir) / f"{pool}.records.json"


def create_key(state_dir: str | Path, pool: str) -> bytes:
    """The pool's key, made (0600, exclusively) when it does not exist yet. Only the authority calls it."""
    p = key_path(state_dir, pool)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_key(state_dir, pool) or b""
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(KEY_BYTES))
    return read_key(state_dir, pool) or b""


def read_key(state_dir: str | Path, pool: str) -> bytes | None:
    p = key_path(state_dir, pool)
    return bytes.fromhex(p.read_text().strip()) if p.is_file() else None


def _canonical(kind: str, name: str, value: Any) -> bytes:
    return json.dumps([kind, name, value], sort_keys=True, separators=(",", ":")).encode()


class Signer:
    """Signs and verifies records with one key."""

    def __init__(self, key: bytes):
        assert len(key) == KEY_BYTES, "an authority key is 32 bytes"
        self._key = key

    def sign(self, kind: str, name: str, value: Any) -> dict[str, Any]:
        sig = hmac.new(self._key, _canonical(kind, name, value), hashlib.sha256).hexdigest()
        return {"kind": kind, "name": name, "value": value, "sig": sig}

    def verify(self, record: Any) -> str | None:
        """None for a record the authority wrote, else the one line that reports it."""
        if not isinstance(record, dict) or not {"kind", "name", "value"} <= set(record):
            return f"record {str(record)[:80]!r}: not a record (kind, name, value, sig); ignored"
        what = f"{record['kind']} {record['name']}"
        sig = record.get("sig")
        if not isinstance(sig, str) or not sig:
            return f"{what}: no signature (not written by the pool authority); ignored"
        want = hmac.new(self._key, _canonical(record["kind"], record["name"], record["value"]), hashlib.sha256)
        if not hmac.compare_digest(want.hexdigest(), sig):
            return f"{what}: bad signature (not written by the pool authority); ignored"
        return None


@dataclass
class Records:
    """What a reader believes of a pool's records: the verified ones by kind and name, and the reports."""

    by_kind: dict[str, dict[str, Any]] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)

    def of(self, kind: str) -> dict[str, Any]:
        return self.by_kind.get(kind, {})


def write(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """Replace the records file at once (write a temporary file, then rename): readers never see half of it."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"records": list(records)}, f, separators=(",", ":"))
    os.replace(tmp, path)


def read(path: Path, signer: Signer | None) -> Records:
    """The records at ``path`` that ``signer`` verifies; every other one is reported in ``ignored``. Without a
    key (no authority ever started) nothing can be verified: every record is reported."""
    out = Records()
    if not path.is_file():
        return out
    try:
        tree = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        out.ignored.append(f"{path}: not JSON ({e.msg}); every record in it ignored")
        return out
    items = tree.get("records") if isinstance(tree, dict) else None
    if not isinstance(items, list):
        out.ignored.append(f"{path}: no records list; ignored")
        return out
    for r in items:
        why = "no authority key to verify with; ignored" if signer is None else signer.verify(r)
        if why is not None:
            out.ignored.append(why if signer is not None else f"{r.get('kind')} {r.get('name')}: {why}")
            continue
        out.by_kind.setdefault(r["kind"], {})[r["name"]] = r["value"]
    return out


def read_pool(state_dir: str | Path, pool: str) -> Records:
    """The verified records of ``pool``'s authority (nothing when it never ran)."""
    key = read_key(state_dir, pool)
    path = records_path(state_dir, pool)
    if key is None and not path.is_file():
        return Records()
    return read(path, Signer(key) if key is not None else None)
