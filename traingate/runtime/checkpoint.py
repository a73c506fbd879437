"""Checkpoints: one directory per global step, ``manifest.json`` written LAST.

Layout under the root URI (``file://``, ``s3://`` or any fsspec URI)::

    step_00000040/model.pt
    step_00000040/train_state.pt
    step_00000040/manifest.json      # sha256 + size of every file, run identity, metrics

A directory without a valid manifest is not a checkpoint: ``find_latest`` trusts
manifests only and falls back past a newest one whose checksums fail, with a warning.

``save`` snapshots the state into host memory (reused buffers, so a steady-state
snapshot is a memcpy, not an allocation) and returns; serialising, hashing, fsync and
upload run on one background thread. At most one save is in flight: a new save either
waits for it (``in_flight="wait"``) or is skipped (``"skip"``), never interleaves.
For a remote root the files are written to a local staging directory first, then
uploaded, manifest last. Loads check every checksum, then ``torch.load(weights_only=True)``:
a file holding any pickled object outside torch's allowlist is refused, not executed.

>>> import tempfile, torch
>>> root = tempfile.mkdtemp()
>>> ck = Checkpointer("file://" + root)
>>> ck.save(3, {"model": {"w": torch.ones(2)}}); ck.wait()
True
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
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from traingate.runtime.storage import Storage, is_transient

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
STAGING_PREFIX = ".ckpt-staging-"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
InFlightPolicy = Literal["wait", "skip"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or is not valid to load."""


class CheckpointRefused(CheckpointError, ValueError):
    """A checkpoint holds something unsafe to unpickle. Never fallen back past silently.

    A ValueError too: retrying cannot help, so the runtime exits as a user error (not retried).
    """


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


def snapshot(obj: Any, buffers: dict[tuple, torch.Tensor] | None = None, path: tuple = ()) -> Any:
    """A deep copy with every tensor copied to host memory: the only part of a save training waits for.

    With ``buffers`` (a dict kept between saves), tensors are copied into the buffers of
    the previous snapshot when shape and dtype match, which avoids allocating (and
    page-faulting) hundreds of MB per checkpoint.
    """
    if isinstance(obj, torch.Tensor):
        src = obj.detach()
        if buffers is None or not src.is_contiguous():
            return src.to("cpu", copy=True)
        buf = buffers.get(path)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = buffers[path] = torch.empty_like(src, device="cpu", pin_memory=src.is_cuda)
        buf.copy_(src, non_blocking=src.is_cuda)
        return buf
    if isinstance(obj, dict):
        return {k: snapshot(v, buffers, (*path, k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v, buffers, (*path, i)) for i, v in enumerate(obj))
    return obj


@dataclass(frozen=True)
class RetentionPolicy:
    """Which complete checkpoints survive: the last K, every Mth step, and the best N by a metric.

    >>> RetentionPolicy(keep_last=1, keep_every=20).keep([10, 20, 30])
    {20, 30}
    >>> RetentionPolicy(keep_last=1, keep_best=1, best_metric="loss").keep([10, 20, 30], {10: 0.1, 20: 0.5, 30: 0.9})
    {10, 30}
    """

    keep_last: int = 3
    keep_every: int | None = None
    keep_best: int = 0
    best_metric: str | None = None
    best_mode: Literal["min", "max"] = "min"

    def keep(self, steps: list[int], metrics: dict[int, float] | None = None) -> set[int]:
        steps = sorted(steps)
        kept = set(steps[-self.keep_last:])
        if self.keep_every:
            kept |= {s for s in steps if s % self.keep_every == 0}
        if self.keep_best and metrics:
            scored = [s for s in steps if s in metrics]
            sign = 1.0 if self.best_mode == "min" else -1.0
            # Ties go to the newer step: it holds more training for the same score.
            kept |= set(sorted(scored, key=lambda s: (sign * metrics[s], -s))[:self.keep_best])
        return kept


class _HashingWriter:
    """A file object torch.save streams into: hashes and counts bytes as they go to disk."""

    def __init__(self, f: Any):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        self.sha.update(data)
        self.size += len(memoryview(data).cast("B"))
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e  # torch's zip writer replaces it with a RuntimeError on its way out
            raise

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    """Save/find/load step-numbered checkpoints under one root URI (see module docstring)."""

    def __init__(self, root_uri: str, retention: RetentionPolicy = RetentionPolicy(),
                 async_save: bool = True, staging_dir: str | None = None,
                 fault_hook: Callable[[str, int], None] | None = None, in_flight: InFlightPolicy = "wait"):
        if in_flight not in ("wait", "skip"):
            raise ValueError(f"in_flight = {in_flight!r}: use 'wait' or 'skip'")
        self.storage = Storage(root_uri)
        self.retention = retention
        self.async_save = async_save
        self.in_flight = in_flight
        self._staging_root = staging_dir or tempfile.gettempdir()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt") if async_save else None
        self._inflight: Future | None = None
        self._inflight_step: int | None = None
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._closed = False
        # Fault injection for drills and atomicity tests: called with a phase name and the step.
        self._fault_hook = fault_hook
        self.last_saved_step: int | None = None
        self.blocked_s = 0.0        # total time training waited on saves (snapshot + waiting for a previous one)
        self.last_blocked_s = 0.0
        self.saves_skipped = 0
        if not self.storage.is_local:
            self._clear_stale_staging()

    @property
    def uri(self) -> str:
        return self.storage.root

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any] | None = None,
             force: bool = False) -> bool:
        """Snapshot ``state`` (name -> object) and write it in the background as ``step_<step>``.

        Returns False when the save was skipped because one is still in flight (policy "skip");
        ``force`` (emergency and final checkpoints) waits instead, whatever the policy.
        ``meta`` goes into the manifest; ``meta["metrics"]`` is what keep-best retention reads.
        """
        t0 = time.perf_counter()
        if self._inflight is not None and not self._inflight.done() and self.in_flight == "skip" and not force:
            self.saves_skipped += 1
            log.warning("checkpoint step %d skipped: the save of step %s is still in flight (in_flight=skip)",
                        step, self._inflight_step)
            return False
        self._raise_if_failed(wait=True)  # at most one save in flight; its buffers are free after this
        # One thread copies: the copy is memory-bound, and on a shared (or busy) machine a parallel
        # copy waits for its slowest, descheduled worker; measured 2-3x slower under load.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            snap = snapshot(state, self._buffers)
        finally:
            torch.set_num_threads(threads)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the device->host copies above are non-blocking
        meta = dict(meta or {})
        if self._pool is None:
            self._write(step, snap, meta)
        else:
            self._inflight, self._inflight_step = self._pool.submit(self._write, step, snap, meta), step
        self.last_blocked_s = time.perf_counter() - t0
        self.blocked_s += self.last_blocked_s
        return True

    def wait(self) -> None:
        """Block until the in-flight save (if any) is durable; raise its error if it failed."""
        self._raise_if_failed(wait=True)

    def close(self, raise_errors: bool = True) -> None:
        """Flush the in-flight save and stop the writer thread. Idempotent.

        ``raise_errors=False`` is for a process already exiting on another error: the
        save's own failure is logged instead of replacing the error being reported.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        except Exception as e:
            if raise_errors:
                raise
            log.error("checkpoint save in flight at exit failed: %s", e)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def _raise_if_failed(self, wait: bool) -> None:
        fut = self._inflight
        if fut is None or (not wait and not fut.done()):
            return
        self._inflight, self._inflight_step = None, None
        fut.result()

    def _fault(self, phase: str, step: int) -> None:
        if self._fault_hook is not None:
            self._fault_hook(phase, step)

    def _clear_stale_staging(self) -> None:
        # Staging directories of saves killed before their upload finished.
        if os.path.isdir(self._staging_root):
            for entry in os.listdir(self._staging_root):
                if entry.startswith(STAGING_PREFIX):
                    shutil.rmtree(os.path.join(self._staging_root, entry), ignore_errors=True)

    def _write(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        name = step_dir(step)
        local = self.storage.is_local
        staging = os.path.join(self.storage._path(), name) if local else None
        try:
            if local:
                os.makedirs(staging, exist_ok=True)
                _fsync_dir(self.storage._path())
            else:
                os.makedirs(self._staging_root, exist_ok=True)
                staging = tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{name}-", dir=self._staging_root)
            # Rewriting a step (a resumed run reaching a step whose earlier save was cut short):
            # invalidate the old manifest before any file changes under it.
            if local:
                if os.path.exists(os.path.join(staging, MANIFEST)):
                    os.remove(os.path.join(staging, MANIFEST))
                    _fsync_dir(staging)
            elif self._manifest(step) is not None:
                self.storage.rm(f"{name}/{MANIFEST}")
            files: dict[str, dict[str, Any]] = {}
            for key, obj in state.items():
                path = os.path.join(staging, f"{key}.pt")
                with open(path, "wb") as f:
                    w = _HashingWriter(f)
                    self._fault("tensor_write", step)
                    try:
                        torch.save(obj, w)
                    except RuntimeError:
                        if w.error is not None:
                            raise w.error from None
                        raise
                    f.flush()
                    os.fsync(f.fileno())
                files[f"{key}.pt"] = {"sha256": w.sha.hexdigest(), "bytes": w.size}
            self._fault("before_manifest", step)
            manifest = {"format": 1, "step": step, "created": time.time(), "files": files, **meta}
            blob = json.dumps(manifest, indent=1, sort_keys=True, default=str).encode()
            if local:
                tmp = os.path.join(staging, MANIFEST + ".tmp")
                with open(tmp, "wb") as f:
                    f.write(blob)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, os.path.join(staging, MANIFEST))
                _fsync_dir(staging)
            else:
                for fname in files:
                    self._fault("upload", step)
                    self.storage.put_file(os.path.join(staging, fname), f"{name}/{fname}")
                self.storage.write_bytes(f"{name}/{MANIFEST}", blob)  # an S3 PUT is all or nothing
            self._fault("after_manifest", step)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                if local and staging:
                    shutil.rmtree(staging, ignore_errors=True)
                prev = self.last_saved_step
                raise CheckpointError(
                    f"checkpoint step {step} not written: {os.strerror(e.errno)} at {self.uri}; "
                    f"previous checkpoint {step_dir(prev) if prev is not None else '(none)'} kept. "
                    "Free space or point checkpoint.uri elsewhere") from e
            raise
        except Exception as e:
            if is_transient(e):
                raise CheckpointError(
                    f"checkpoint step {step} not stored at {self.uri}: the storage kept failing after "
                    f"{self.storage.retries} retries ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                    "previous checkpoint kept") from e
            raise
        finally:
            if not local and staging:
                shutil.rmtree(staging, ignore_errors=True)
        self.last_saved_step = step
        self._apply_retention()

    def _apply_retention(self) -> None:
        manifests = self._complete()
        if not manifests:
            return
        metric = self.retention.best_metric
        scores = {s: float(m["metrics"][metric]) for s, m in manifests.items()
                  if metric and isinstance(m.get("metrics"), dict)
                  and isinstance(m["metrics"].get(metric), (int, float))}
        keep = self.retention.keep(list(manifests), scores)
        newest = max(manifests)
        for entry in self.storage.listdir():
            m = _STEP_DIR.match(entry)
            if not m:
                continue
            s = int(m.group(1))
            # Incomplete older directories are debris of killed saves; newer ones may be being written.
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

    def _complete(self) -> dict[int, dict[str, Any]]:
        out = {}
        for entry in self.storage.listdir():
            m = _STEP_DIR.match(entry)
            if m:
                manifest = self._manifest(int(m.group(1)))
                if manifest is not None:
                    out[int(m.group(1))] = manifest
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
                raise CheckpointError(f"{step_dir(step)}/{fname} fails its sha256 check (corrupt or tampered); "
                                      "it is not loaded")
            out[fname] = data
        return out

    def _load_verified(self, step: int, blobs: dict[str, bytes]) -> dict[str, Any]:
        state = {}
        for fname, data in blobs.items():
            try:
                state[fname.removesuffix(".pt")] = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
            except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError) as e:
                raise CheckpointRefused(
                    f"{self.storage.uri(step_dir(step))}/{fname} refused: it holds objects outside the "
                    f"weights-only allowlist and was not unpickled ({str(e).splitlines()[0][:160]}). "
                    "Do not load it; find out who wrote it") from None
        return state

    def load(self, step: int) -> dict[str, Any]:
        """Verify checksums, then load every entry with weights_only=True (CheckpointError if not valid)."""
        return self._load_verified(step, self._verified_bytes(step))

    def load_latest(self) -> tuple[int, dict[str, Any]] | None:
        """(step, state) of the newest valid checkpoint, reading each file once; None if there is none.

        A newest checkpoint whose checksums fail is skipped with a warning (a torn write);
        one that fails the weights-only allowlist raises :class:`CheckpointRefused`.
        """
        for step in reversed(self.list_steps()):
            try:
                blobs = self._verified_bytes(step)
            except CheckpointError as e:
                log.warning("checkpoint %s skipped: %s", step_dir(step), e)
                continue
            return step, self._load_verified(step, blobs)
        return None
