"""Checkpoints: step-numbered directories, a manifest with checksums written LAST.

A checkpoint is ``<root>/step_<00000042>/`` holding one ``<name>.pt`` file per entry
of the saved state plus ``manifest.json``. No valid manifest, no checkpoint:
``find_latest`` trusts manifests only and falls back past a corrupt newest one.

``save`` snapshots the state to host memory and returns; serialising and uploading
run on one background thread, so at most one save is in flight and saves never
interleave. Loads use ``torch.load(weights_only=True)`` after checking checksums.

>>> import tempfile, torch
>>> root = tempfile.mkdtemp()
>>> ck = Checkpointer("file://" + root)
>>> ck.save(3, {"model": {"w": torch.ones(2)}}); ck.wait()
>>> ck.find_latest(), ck.load(3)["model"]["w"].tolist()
(3, [1.0, 1.0])
"""
from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from traingate.runtime.storage import Storage

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or is not safe/valid to load."""


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


def snapshot(obj: Any) -> Any:
    """A deep copy with every tensor cloned to host memory: the only part of a save training waits for."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return obj


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int = 3
    keep_every: int | None = None

    def keep(self, steps: list[int]) -> set[int]:
        steps = sorted(steps)
        kept = set(steps[-self.keep_last:])
        if self.keep_every:
            kept |= {s for s in steps if s % self.keep_every == 0}
        return kept


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class Checkpointer:
    def __init__(self, root_uri: str, retention: RetentionPolicy = RetentionPolicy(),
                 async_save: bool = True, staging_dir: str | None = None,
                 fault_hook: Any = None):
        self.storage = Storage(root_uri)
        self.retention = retention
        self.async_save = async_save
        self._staging_root = staging_dir
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt") if async_save else None
        self._inflight: Future | None = None
        self._lock = threading.Lock()
        # Fault injection for drills and atomicity tests: called with a phase name.
        self._fault_hook = fault_hook
        self.last_saved_step: int | None = None
        self.blocked_s = 0.0  # total time training waited on saves

    @property
    def uri(self) -> str:
        return self.storage.root

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any] | None = None) -> None:
        """Snapshot ``state`` (name -> object) and write it in the background as ``step_<step>``."""
        t0 = time.perf_counter()
        self._raise_if_failed(wait=True)  # at most one save in flight: wait for the previous one
        snap = snapshot(state)
        meta = dict(meta or {})
        if self._pool is None:
            self._write(step, snap, meta)
        else:
            self._inflight = self._pool.submit(self._write, step, snap, meta)
        self.blocked_s += time.perf_counter() - t0

    def wait(self) -> None:
        """Block until the in-flight save (if any) is durable; raise its error if it failed."""
        self._raise_if_failed(wait=True)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def _raise_if_failed(self, wait: bool) -> None:
        fut = self._inflight
        if fut is None or (not wait and not fut.done()):
            return
        self._inflight = None
        fut.result()

    def _fault(self, phase: str, step: int) -> None:
        if self._fault_hook is not None:
            self._fault_hook(phase, step)

    def _write(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        name = step_dir(step)
        local = self.storage.is_local
        staging = os.path.join(self.storage._path(), name) if local else \
            tempfile.mkdtemp(prefix=f"{name}-", dir=self._staging_root)
        try:
            os.makedirs(staging, exist_ok=True)
            if local and os.path.exists(os.path.join(staging, MANIFEST)):
                os.remove(os.path.join(staging, MANIFEST))  # rewriting a step: invalidate first
            files: dict[str, dict[str, Any]] = {}
            for key, obj in state.items():
                buf = io.BytesIO()
                torch.save(obj, buf)
                data = buf.getvalue()
                self._fault("tensor_write", step)
                path = os.path.join(staging, f"{key}.pt")
                _fsync_write(path, data)
                files[f"{key}.pt"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
            self._fault("before_manifest", step)
            manifest = {"format": 1, "step": step, "created": time.time(), "files": files, **meta}
            blob = json.dumps(manifest, indent=1, sort_keys=True).encode()
            if local:
                tmp = os.path.join(staging, MANIFEST + ".tmp")
                _fsync_write(tmp, blob)
                os.replace(tmp, os.path.join(staging, MANIFEST))
                dfd = os.open(staging, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            else:
                for fname in files:
                    self._fault("upload", step)
                    self.storage.put_file(os.path.join(staging, fname), f"{name}/{fname}")
                self.storage.write_bytes(f"{name}/{MANIFEST}", blob)
            self._fault("after_manifest", step)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                if local:
                    shutil.rmtree(staging, ignore_errors=True)
                prev = self.last_saved_step
                raise CheckpointError(
                    f"checkpoint step {step} not written: {os.strerror(e.errno)} at {self.uri}; "
                    f"previous checkpoint {prev if prev is not None else '(none)'} kept. "
                    "Free space or point checkpoint.uri elsewhere") from e
            raise
        finally:
            if not local:
                shutil.rmtree(staging, ignore_errors=True)
        self.last_saved_step = step
        self._apply_retention()

    def _apply_retention(self) -> None:
        complete = self.list_steps()
        if not complete:
            return
        keep = self.retention.keep(complete)
        newest = max(complete)
        for entry in self.storage.listdir():
            m = _STEP_DIR.match(entry)
            if not m:
                continue
            s = int(m.group(1))
            # Incomplete older directories are debris of killed saves; newer ones may be in flight elsewhere.
            if s not in keep and s < newest:
                self.storage.rm(entry)

    # ------------------------------------------------------------------ find / load
    def _manifest(self, step: int) -> dict[str, Any] | None:
        try:
            raw = self.storage.read_bytes(f"{step_dir(step)}/{MANIFEST}")
        except FileNotFoundError:
            return None
        try:
            m = json.loads(raw)
        except ValueError:
            return None
        return m if isinstance(m, dict) and m.get("step") == step and isinstance(m.get("files"), dict) else None

    def list_steps(self) -> list[int]:
        """Steps with a readable manifest, ascending (contents not yet verified)."""
        steps = []
        for entry in self.storage.listdir():
            m = _STEP_DIR.match(entry)
            if m and self._manifest(int(m.group(1))) is not None:
                steps.append(int(m.group(1)))
        return sorted(steps)

    def find_latest(self, verify: bool = True) -> int | None:
        """Newest step whose manifest is complete (and, with verify, whose checksums match)."""
        for step in reversed(self.list_steps()):
            if not verify:
                return step
            try:
                self._verified_bytes(step)
                return step
            except CheckpointError as e:
                log.warning("checkpoint %s skipped: %s", step_dir(step), e)
        return None

    def manifest(self, step: int) -> dict[str, Any]:
        m = self._manifest(step)
        if m is None:
            raise CheckpointError(f"{self.storage.uri(step_dir(step))} has no valid manifest; it is not a checkpoint")
        return m

    def _verified_bytes(self, step: int) -> dict[str, bytes]:
        m = self.manifest(step)
        out = {}
        for fname, info in m["files"].items():
            try:
                data = self.storage.read_bytes(f"{step_dir(step)}/{fname}")
            except FileNotFoundError:
                raise CheckpointError(f"{step_dir(step)}/{fname} is listed in the manifest but missing") from None
            if hashlib.sha256(data).hexdigest() != info["sha256"]:
                raise CheckpointError(f"{step_dir(step)}/{fname} fails its sha256 check (corrupt or tampered)")
            out[fname] = data
        return out

    def load(self, step: int) -> dict[str, Any]:
        """Verify checksums, then load every entry with weights_only=True."""
        state = {}
        for fname, data in self._verified_bytes(step).items():
            try:
                state[fname.removesuffix(".pt")] = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
            except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError) as e:
                raise CheckpointError(
                    f"{step_dir(step)}/{fname} refused: it holds objects outside the weights-only allowlist "
                    f"({str(e).splitlines()[0][:160]})") from None
        return state
