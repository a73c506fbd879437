"""The checkpoints under a URI, read from their manifests: which steps exist, each one's manifest,
and whether its files match their checksums. No torch: the orchestrator (run records, promotion, a
resume point) reads checkpoints without importing the training stack. :class:`Checkpointer
<traingate.runtime.checkpoint.Checkpointer>`, which writes and loads them, is a catalog too.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
from typing import Any

from traingate.storage import RefusedPath, Storage

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
# What a manifest may name: a file of its own directory. No separators, no leading dot (so no
# '..'), which also keeps out the temporary names of files being written.
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or is not valid to load."""


class CheckpointRefused(CheckpointError, ValueError):
    """A checkpoint that is unsafe or not this run's to load. Never fallen back past silently.

    A ValueError too: retrying cannot help, so the runtime exits as a user error (not retried).
    """


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


SIGNATURE = "signature"
_SCHEME = "hmac-sha256:"


def _canonical(manifest: dict[str, Any]) -> bytes:
    return json.dumps(
        {k: v for k, v in manifest.items() if k != SIGNATURE}, sort_keys=True, separators=(",", ":"), default=str
    ).encode()


def sign(manifest: dict[str, Any], key: bytes) -> str:
    """The signature of a manifest (every field but the signature itself) under a deployment's key.

    It covers the checksum of every file and the run identity: recomputing a checksum after changing a
    file, or re-stamping another run's checkpoint with this run's identity, needs the key.

    >>> m = {"step": 4, "files": {"model.pt": {"sha256": "ab"}}, "run_id": "r1"}
    >>> sign(m, b"k" * 32) == sign(dict(m, signature="x"), b"k" * 32) != sign(dict(m, run_id="r2"), b"k" * 32)
    True
    """
    return _SCHEME + hmac.new(key, _canonical(manifest), hashlib.sha256).hexdigest()


class CheckpointCatalog:
    """The checkpoints under ``root_uri``. A checkpoint without a valid manifest does not exist.

    >>> import tempfile
    >>> CheckpointCatalog("file://" + tempfile.mkdtemp()).find_latest() is None
    True
    """

    def __init__(self, root_uri: str, key: bytes | None = None):
        """``key``: the deployment's checkpoint key (traingate.settings.checkpoint_key). With it, every
        manifest is signed on save and a manifest whose signature does not match is refused on load."""
        self.storage = Storage(root_uri)
        self.key = key

    def _refused(self, step: int, reason: str, fix: str) -> CheckpointRefused:
        return CheckpointRefused(f"checkpoint {self.storage.uri(step_dir(step))} refused: {reason}. {fix}")

    def _link_refused(self, step: int) -> CheckpointRefused:
        target = os.readlink(self.storage._path(step_dir(step)))
        return self._refused(
            step, f"it is a symbolic link to {target}", "A checkpoint is a plain directory; remove the link"
        )

    def _manifest(self, step: int) -> dict[str, Any] | None:
        if self.storage.is_link(step_dir(step)):
            raise self._link_refused(step)
        try:
            raw = self.storage.read_bytes(f"{step_dir(step)}/{MANIFEST}")
        except FileNotFoundError:
            return None
        except RefusedPath as e:
            raise self._refused(step, e.strerror or str(e), "Remove it; a checkpoint holds plain files only") from None
        try:
            m = json.loads(raw)
        except ValueError:
            return None
        return m if isinstance(m, dict) and m.get("step") == step and isinstance(m.get("files"), dict) else None

    def _complete(self, strict: bool = True) -> dict[int, dict[str, Any]]:
        """step -> manifest of every step directory with a valid manifest.

        ``strict``: a link in place of a step directory or a manifest raises CheckpointRefused;
        otherwise (retention, which must not fail a save over it) it is passed over.
        """
        out = {}
        for entry in self.storage.listdir():
            m = _STEP_DIR.match(entry)
            if not m:
                continue
            step = int(m.group(1))
            try:
                manifest = self._manifest(step)
            except CheckpointRefused:
                if strict:
                    raise
                continue
            if manifest is not None:
                out[step] = manifest
        return out

    def list_steps(self) -> list[int]:
        """Steps with a readable manifest, ascending (contents not yet verified)."""
        return sorted(self._complete())

    def find_latest(self, verify: bool = True) -> int | None:
        """Newest step whose manifest is complete (and, with verify, whose checksums match)."""
        for step in reversed(self.list_steps()):
            if not verify:
                return step
            try:
                self._verified_bytes(step)
                return step
            except CheckpointRefused:
                raise
            except CheckpointError as e:
                log.warning("checkpoint %s skipped: %s", step_dir(step), e)
        return None

    def check_signature(self, step: int, manifest: dict[str, Any]) -> None:
        """Refuse a manifest this deployment's key did not sign (nothing to check without a key)."""
        if self.key is None:
            return
        given = manifest.get(SIGNATURE)
        if not isinstance(given, str):
            raise self._refused(
                step,
                "its manifest carries no signature, so nothing shows this deployment wrote it",
                "Resume only from checkpoints this deployment wrote, or start from it on purpose with "
                "Checkpointer.init_from after checking where it came from",
            )
        if not hmac.compare_digest(given, sign(manifest, self.key)):
            raise self._refused(
                step,
                "its manifest's signature does not match this deployment's checkpoint key (a file or its "
                "checksum, or the run identity, changed after it was signed; or another key signed it)",
                "Do not resume from it; find out who changed it",
            )

    def unreadable_after(self, step: int | None) -> dict[int, str]:
        """Step directories newer than ``step`` whose manifest exists but cannot be read: step -> reason.

        A step directory without a manifest is a save cut short (it never existed); one with a manifest
        that is not valid JSON or names another step was damaged after it was written.
        """
        out = {}
        for entry in self.storage.listdir():
            m = _STEP_DIR.match(entry)
            if not m or (step is not None and int(m.group(1)) <= step):
                continue
            n = int(m.group(1))
            if self.storage.exists(f"{entry}/{MANIFEST}") and self._manifest(n) is None:
                out[n] = f"{entry}/{MANIFEST} is unreadable (truncated, or not the manifest of {entry})"
        return out

    def manifest(self, step: int) -> dict[str, Any]:
        m = self._manifest(step)
        if m is None:
            raise CheckpointError(f"{self.storage.uri(step_dir(step))} has no valid manifest; it is not a checkpoint")
        return m

    def _verified_bytes(self, step: int) -> tuple[dict[str, Any], dict[str, bytes]]:
        """(manifest, file name -> bytes): names checked, no link followed, every checksum matching."""
        m = self.manifest(step)
        for fname in m["files"]:
            if not _PLAIN_NAME.match(fname) or fname == MANIFEST:
                raise self._refused(
                    step,
                    f"its manifest lists {fname!r}, not a plain file of {step_dir(step)}",
                    "A manifest may name only files of its own directory; find out who wrote it",
                )
        out = {}
        for fname, info in m["files"].items():
            try:
                data = self.storage.read_bytes(f"{step_dir(step)}/{fname}")
            except FileNotFoundError:
                raise CheckpointError(f"{step_dir(step)}/{fname} is listed in the manifest but missing") from None
            except RefusedPath as e:
                raise self._refused(
                    step, e.strerror or str(e), "A checkpoint holds plain files only; remove it"
                ) from None
            if not isinstance(info, dict) or hashlib.sha256(data).hexdigest() != info.get("sha256"):
                raise CheckpointError(
                    f"{step_dir(step)}/{fname} fails its sha256 check (corrupt or tampered); it is not loaded"
                )
            out[fname] = data
        return m, out
