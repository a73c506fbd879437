"""Checkpoints: one directory per global step, ``manifest.json`` written LAST.

Layout under the root URI (``file://``, ``s3://`` or any fsspec URI)::

    step_00000040/model.pt
    step_00000040/train_state.pt
    step_00000040/manifest.json      # sha256 + size of every file, run identity, metrics

A directory without a valid manifest is not a checkpoint: ``find_latest`` trusts
manifests only and falls back past a newest one whose checksums fail, with a warning
(``load_latest`` also tells ``on_fallback``, which the runtime turns into an alert and a
restart entry in the run's logbook). Built with the deployment's ``key``, every manifest is
signed (HMAC-SHA256, :func:`traingate.job.catalog.sign`) and a load refuses a manifest the key
did not sign: a file changed with its checksum recomputed, or another run's checkpoint
re-stamped with this run's identity.

What is refused (:class:`CheckpointRefused`), never fallen back past: a manifest entry that
is not a plain file name of its own directory (``../``, absolute paths); a symbolic link in
place of a step directory or a file (on a local root; listing refuses too); a file holding
pickled objects outside torch's weights-only allowlist; a state whose ``train_state.step``
differs from its manifest's step; and, for a Checkpointer built with the resuming run's
identity (``run_id``, ``stage``, ``spec``), a checkpoint of another run, another stage or a
spec with another resume fingerprint (see :mod:`traingate.runtime.fingerprint`). A
Checkpointer built without an identity (tools, tests) checks nothing of the kind. Starting
from another run's checkpoint on purpose is :meth:`Checkpointer.init_from`.

``save`` snapshots the state into host memory (reused buffers, so a steady-state
snapshot is a memcpy, not an allocation; :meth:`Checkpointer.prepare` allocates them before
training, so the first snapshot is one too) and returns; serialising, hashing, fsync and
upload run on one background thread. At most one save is in flight: a new save either
waits for it (``in_flight="wait"``) or is skipped (``"skip"``), never interleaves.
For a remote root the files are written to a local staging directory first, then
uploaded, manifest last. On a local root every file is written under a fresh temporary
name and renamed into place, and a link in place of the step directory is replaced by a
directory, so a save never writes through a link planted in the checkpoint. Loads check
every checksum, then ``torch.load(weights_only=True)``: a file holding any pickled object
outside torch's allowlist is refused, not executed.

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
import mmap
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, Literal

import torch

from traingate.job.catalog import (
    _STEP_DIR,
    MANIFEST,
    SIGNATURE,
    CheckpointCatalog,
    CheckpointError,
    CheckpointRefused,
    sign,
    step_dir,
)
from traingate.runtime.fingerprint import ResumeIdentity
from traingate.storage import atomic_file, is_temporary, is_transient

if TYPE_CHECKING:
    from traingate.spec import RunSpec

log = logging.getLogger(__name__)
STAGING_PREFIX = ".ckpt-staging-"


def _staging_owner_alive(entry: str) -> bool:
    """Whether the process that made staging directory ``entry`` (``<prefix><name>-<pid>-<random>``) still runs.
    A name without a pid is treated as stale."""
    parts = entry[len(STAGING_PREFIX) :].split("-")
    if len(parts) < 3 or not parts[-2].isdigit():
        return False
    try:
        os.kill(int(parts[-2]), 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, owned by someone else
        return True
    return True


ASIDE = "aside"  # checkpoints a roll-back went back from (Checkpointer.set_aside_after)
InFlightPolicy = Literal["wait", "skip"]


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _fault_in(buf: torch.Tensor) -> None:
    # One write per page makes the kernel map the page now rather than in the middle of a snapshot.
    # A strided write touches 1/4096 of the bytes: cheap, and it leaves the memory bus to training.
    if buf.numel() == 0 or buf.is_pinned():  # pinned memory is resident from the start
        return
    flat = buf.reshape(-1).view(torch.uint8)
    flat[:: mmap.PAGESIZE].zero_()
    flat[-1:].zero_()


class HostBuffers:
    """Host tensors for snapshots, reused between saves by (shape, dtype, pinned).

    The buffers a snapshot takes stay lent until its write is done; :meth:`recycle` then makes
    them the free ones the next snapshot takes, so a steady-state snapshot allocates nothing.
    Buffers set aside by :meth:`reserve` that the first snapshot does not take are dropped then.
    """

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lent: list[tuple[tuple, torch.Tensor]] = []

    @staticmethod
    def _key(shape: Any, dtype: torch.dtype, pinned: bool) -> tuple:
        return tuple(shape), dtype, pinned

    def take(self, src: torch.Tensor) -> torch.Tensor:
        key = self._key(src.shape, src.dtype, src.is_cuda)
        free = self._free.get(key)
        buf = free.pop() if free else torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
        self._lent.append((key, buf))
        return buf

    def recycle(self) -> None:
        """The previous snapshot is durable: its buffers are the next snapshot's."""
        if not self._lent:
            return
        free: dict[tuple, list[torch.Tensor]] = {}
        for key, buf in self._lent:
            free.setdefault(key, []).append(buf)
        self._free, self._lent = free, []

    def reserve(self, shapes: list[tuple], copies: int) -> None:
        for shape, dtype, pinned in shapes:
            for _ in range(copies):
                buf = torch.empty(shape, dtype=dtype, pin_memory=pinned)
                _fault_in(buf)
                self._free.setdefault(self._key(shape, dtype, pinned), []).append(buf)

    @property
    def nbytes(self) -> int:
        bufs = [b for free in self._free.values() for b in free] + [b for _, b in self._lent]
        return sum(b.numel() * b.element_size() for b in bufs)


def snapshot(obj: Any, host: HostBuffers | None = None) -> Any:
    """A deep copy with every tensor copied to host memory: the only part of a save training waits for.

    With ``host``, tensors are copied into its reused buffers, which avoids allocating (and
    page-faulting) hundreds of MB per checkpoint.
    """
    if isinstance(obj, torch.Tensor):
        src = obj.detach()
        if host is None or not src.is_contiguous():
            return src.to("cpu", copy=True)
        buf = host.take(src)
        buf.copy_(src, non_blocking=src.is_cuda)
        return buf
    if isinstance(obj, dict):
        return {k: snapshot(v, host) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v, host) for v in obj)
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
        kept = set(steps[-self.keep_last :])
        if self.keep_every:
            kept |= {s for s in steps if s % self.keep_every == 0}
        if self.keep_best and metrics:
            scored = [s for s in steps if s in metrics]
            sign = 1.0 if self.best_mode == "min" else -1.0
            # Ties go to the newer step: it holds more training for the same score.
            kept |= set(sorted(scored, key=lambda s: (sign * metrics[s], -s))[: self.keep_best])
        return kept


def _state_bytes(obj: Any) -> int:
    """Bytes of tensor data in a state tree: what torch.save writes, give or take its small header."""
    if isinstance(obj, torch.Tensor):
        return obj.nelement() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_state_bytes(v) for v in obj)
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    return 0


def _free_bytes(path: str) -> int:
    # The step directory was just removed and the root may never have been created: ask its nearest parent.
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return shutil.disk_usage(path or "/").free


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


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


class Checkpointer(CheckpointCatalog):
    """Save/find/load step-numbered checkpoints under one root URI (see module docstring)."""

    def __init__(
        self,
        root_uri: str,
        retention: RetentionPolicy = RetentionPolicy(),
        async_save: bool = True,
        staging_dir: str | None = None,
        fault_hook: Callable[[str, int], None] | None = None,
        in_flight: InFlightPolicy = "wait",
        run_id: str | None = None,
        stage: str | None = None,
        spec: RunSpec | None = None,
        key: bytes | None = None,
        on_fallback: Callable[[str, str], None] | None = None,
    ):
        """``run_id``, ``stage`` and ``spec`` (all three or none): the identity of the run that resumes
        from here. Saves are stamped with it and loads refuse a checkpoint that is not its own.
        ``key``: the deployment's checkpoint key; saves are signed with it and loads refuse a manifest
        it did not sign. ``on_fallback(file, reason)``: told of each newer checkpoint :meth:`load_latest`
        passes over (a torn or damaged write), before it loads an older one."""
        if in_flight not in ("wait", "skip"):
            raise ValueError(f"in_flight = {in_flight!r}: use 'wait' or 'skip'")
        given = [x is not None for x in (run_id, stage, spec)]
        if any(given) and not all(given):
            raise ValueError(
                "Checkpointer: run_id, stage and spec go together (the identity a resume is checked "
                "against); pass all three or none"
            )
        self.expect = (
            ResumeIdentity.of(run_id, stage, spec)
            if run_id is not None and stage is not None and spec is not None
            else None
        )
        super().__init__(root_uri, key)
        self.on_fallback = on_fallback
        self.retention = retention
        self.async_save = async_save
        self.in_flight = in_flight
        self._staging_root = staging_dir or tempfile.gettempdir()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt") if async_save else None
        self._inflight: Future | None = None
        self._inflight_step: int | None = None
        self._host = HostBuffers()
        self._preparing: Future | None = None
        self.prepare_s: float | None = None  # how long prepare() took (in the background when async)
        self._closed = False
        # Fault injection for drills and atomicity tests: called with a phase name and the step.
        self._fault_hook = fault_hook
        self.last_saved_step: int | None = None
        self.blocked_s = 0.0  # total time training waited on saves (snapshot + waiting for a previous one)
        self.last_blocked_s = 0.0
        self.saves_skipped = 0
        # Steps retention never removes: the last good checkpoint before an alert window (pin_latest_before).
        self.pinned: set[int] = set()
        if not self.storage.is_local:
            self._clear_stale_staging()

    @property
    def uri(self) -> str:
        return self.storage.root

    # ------------------------------------------------------------------ save
    def prepare(self, template: Any, copies: int = 1) -> None:
        """Allocate and fault in the host buffers of ``copies`` snapshots of every tensor in ``template``.

        Called once before training, it takes the allocation off the first checkpoint (576 MiB
        of page faults for a 50M-parameter model with AdamW state). With async saves it runs on
        the writer thread and returns at once; a save waits for it, so the two never race. Only
        shapes and dtypes are read from ``template``. A fresh AdamW run has no optimizer state
        before its first step: pass the model's state_dict with ``copies=3`` (the weights and
        the two moments, which have the weights' shapes).
        """
        if copies < 1:
            raise ValueError(f"prepare: copies = {copies}; use 1 or more")
        shapes = [(tuple(t.shape), t.dtype, t.is_cuda) for t in _tensors(template) if t.is_contiguous()]

        def reserve() -> None:
            t0 = time.perf_counter()
            self._host.reserve(shapes, copies)
            self.prepare_s = time.perf_counter() - t0

        if self._pool is None:
            reserve()
        else:
            self._await_prepared()
            self._preparing = self._pool.submit(reserve)

    def _await_prepared(self) -> None:
        fut, self._preparing = self._preparing, None
        if fut is not None:
            fut.result()

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any] | None = None, force: bool = False) -> bool:
        """Snapshot ``state`` (name -> object) and write it in the background as ``step_<step>``.

        Returns False when the save was skipped because one is still in flight (policy "skip");
        ``force`` (emergency and final checkpoints) waits instead, whatever the policy.
        ``meta`` goes into the manifest; ``meta["metrics"]`` is what keep-best retention reads.
        """
        t0 = time.perf_counter()
        if self._inflight is not None and not self._inflight.done() and self.in_flight == "skip" and not force:
            self.saves_skipped += 1
            log.warning(
                "checkpoint step %d skipped: the save of step %s is still in flight (in_flight=skip)",
                step,
                self._inflight_step,
            )
            return False
        self._raise_if_failed(wait=True)  # at most one save in flight; its buffers are free after this
        self._await_prepared()
        self._host.recycle()
        # One thread copies: the copy is memory-bound, and on a shared (or busy) machine a parallel
        # copy waits for its slowest, descheduled worker; measured 2-3x slower under load.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            snap = snapshot(state, self._host)
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
            self._await_prepared()
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
        # Staging directories of saves killed before their upload finished. The default root is the system's
        # temp dir, shared with every other process saving to a remote store: a directory whose saving process
        # is alive (its pid is in the name) is another save in progress and stays.
        if os.path.isdir(self._staging_root):
            for entry in os.listdir(self._staging_root):
                if entry.startswith(STAGING_PREFIX) and not _staging_owner_alive(entry):
                    shutil.rmtree(os.path.join(self._staging_root, entry), ignore_errors=True)

    def _serialise(self, step: int, obj: Any, f: BinaryIO) -> dict[str, Any]:
        w = _HashingWriter(f)
        self._fault("tensor_write", step)
        try:
            torch.save(obj, w)  # type: ignore[arg-type]  # any object with write() is a file to torch.save
        except RuntimeError:
            if w.error is not None:
                raise w.error from None
            raise
        return {"sha256": w.sha.hexdigest(), "bytes": w.size}

    def _manifest_blob(self, manifest: dict[str, Any]) -> bytes:
        if self.expect is not None:
            manifest.update(self.expect.stamp())
        if self.key is not None:
            # Signed as it will be read back: JSON's view of it (tuples as lists, other objects as str).
            manifest = json.loads(json.dumps(manifest, default=str))
            manifest[SIGNATURE] = sign(manifest, self.key)
        return json.dumps(manifest, indent=1, sort_keys=True, default=str).encode()

    def _write(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        name = step_dir(step)
        local = self.storage.is_local
        staging = None
        try:
            if local:
                # A link in place of the step directory is replaced, not written through (local_dir).
                with self.storage.local_dir(name) as dfd:
                    # Rewriting a step (a resumed run reaching a step whose earlier save was cut short):
                    # invalidate the old manifest before any file changes under it, and drop the
                    # temporary files of the killed save.
                    stale = [e for e in os.listdir(dfd) if e == MANIFEST or is_temporary(e)]
                    for entry in stale:
                        os.unlink(entry, dir_fd=dfd)
                    if stale:
                        os.fsync(dfd)
                    files: dict[str, dict[str, Any]] = {}
                    for key, obj in state.items():
                        with atomic_file(dfd, f"{key}.pt") as f:
                            files[f"{key}.pt"] = self._serialise(step, obj, f)
                    self._fault("before_manifest", step)
                    blob = self._manifest_blob(
                        {"format": 1, "step": step, "created": time.time(), "files": files, **meta}
                    )
                    with atomic_file(dfd, MANIFEST) as f:
                        f.write(blob)
            else:
                os.makedirs(self._staging_root, exist_ok=True)
                staging = tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{name}-{os.getpid()}-", dir=self._staging_root)
                if self.storage.exists(f"{name}/{MANIFEST}"):  # a rewritten step: old manifest first (see above)
                    self.storage.rm(f"{name}/{MANIFEST}")
                files = {}
                for key, obj in state.items():
                    with open(os.path.join(staging, f"{key}.pt"), "wb") as f:  # a fresh private directory
                        files[f"{key}.pt"] = self._serialise(step, obj, f)
                        f.flush()
                        os.fsync(f.fileno())
                self._fault("before_manifest", step)
                blob = self._manifest_blob({"format": 1, "step": step, "created": time.time(), "files": files, **meta})
                for fname in files:
                    self._fault("upload", step)
                    self.storage.put_file(os.path.join(staging, fname), f"{name}/{fname}")
                self.storage.write_bytes(f"{name}/{MANIFEST}", blob)  # an S3 PUT is all or nothing
            self._fault("after_manifest", step)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                if local:
                    shutil.rmtree(os.path.join(self.storage._path(), name), ignore_errors=True)
                prev = self.last_saved_step
                # A remote root fills its local staging directory, not the bucket.
                where = self.storage._path() if local else self._staging_root
                raise CheckpointError(
                    f"checkpoint step {step} not written: {os.strerror(e.errno)} at {self.uri}: "
                    f"{_mib(_free_bytes(where))} free at {where}, this checkpoint needs about "
                    f"{_mib(_state_bytes(state))}; previous checkpoint "
                    f"{step_dir(prev) if prev is not None else '(none)'} kept. "
                    "Free space or point checkpoint.uri elsewhere"
                ) from e
            raise
        except Exception as e:
            if is_transient(e):
                raise CheckpointError(
                    f"checkpoint step {step} not stored at {self.uri}: the storage kept failing after "
                    f"{self.storage.retries} retries ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                    "previous checkpoint kept"
                ) from e
            raise
        finally:
            if staging:
                shutil.rmtree(staging, ignore_errors=True)
        self.last_saved_step = step
        self._apply_retention()

    def _apply_retention(self) -> None:
        manifests = self._complete(strict=False)
        if not manifests:
            return
        metric = self.retention.best_metric
        scores = {
            s: float(m["metrics"][metric])
            for s, m in manifests.items()
            if metric and isinstance(m.get("metrics"), dict) and isinstance(m["metrics"].get(metric), (int, float))
        }
        keep = self.retention.keep(list(manifests), scores) | self.pinned
        newest = max(manifests)
        # Checkpoints a roll-back set aside are removed once the run is past them again.
        for entry in self.storage.listdir(ASIDE):
            m = _STEP_DIR.match(entry)
            if m and int(m.group(1)) <= newest:
                self.storage.rm(f"{ASIDE}/{entry}")
        for entry in self.storage.listdir():
            m = _STEP_DIR.match(entry)
            # A link is not ours to remove; listing refuses it loudly instead.
            if not m or self.storage.is_link(entry):
                continue
            s = int(m.group(1))
            # Incomplete older directories are debris of killed saves; newer ones may be being written.
            if s not in keep and s < newest:
                self.storage.rm(entry)

    # ------------------------------------------------------------------ load (finding: CheckpointCatalog)
    def pin_latest_before(self, step: int) -> int | None:
        """Keep the newest complete checkpoint before ``step`` whatever the retention policy says, for as
        long as this Checkpointer lives (the last good state before an alert window). Returns its step."""
        self.wait()
        good = max((s for s in self.list_steps() if s < step), default=None)
        if good is not None:
            self.pinned.add(good)
        return good

    def set_aside_after(self, step: int) -> list[int]:
        """Move every checkpoint after ``step`` out of the way (a roll-back: no restart may resume from
        the state it went back from) into ``aside/``, where retention removes each once a later save
        passes its step: until then the run that went back keeps them. Returns the steps moved."""
        self.wait()
        moved = []
        for entry in self.storage.listdir():
            m = _STEP_DIR.match(entry)
            if not m or int(m.group(1)) <= step or self.storage.is_link(entry):
                continue
            if self.storage.is_local:
                aside = self.storage._path(ASIDE)
                os.makedirs(aside, exist_ok=True)
                # An older copy an earlier roll-back set aside gives way to this one.
                shutil.rmtree(os.path.join(aside, entry), ignore_errors=True)
                os.replace(self.storage._path(entry), os.path.join(aside, entry))
            else:  # an object store has no rename: copy each file, the manifest last, then remove the original
                names = [n for n in self.storage.listdir(entry) if n != MANIFEST] + [MANIFEST]
                for name in names:
                    if self.storage.exists(f"{entry}/{name}"):
                        self.storage.write_bytes(f"{ASIDE}/{entry}/{name}", self.storage.read_bytes(f"{entry}/{name}"))
                self.storage.rm(entry)
            moved.append(int(m.group(1)))
        return sorted(moved)

    def set_aside_steps(self) -> list[int]:
        """Steps a roll-back set aside that no save has passed yet."""
        return sorted(int(m.group(1)) for e in self.storage.listdir(ASIDE) if (m := _STEP_DIR.match(e)))

    def _load_checked(self, step: int, manifest: dict[str, Any], blobs: dict[str, bytes]) -> dict[str, Any]:
        state = {}
        for fname, data in blobs.items():
            try:
                state[fname.removesuffix(".pt")] = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
            except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError) as e:
                raise CheckpointRefused(
                    f"{self.storage.uri(step_dir(step))}/{fname} refused: it holds objects outside the "
                    f"weights-only allowlist and was not unpickled ({str(e).splitlines()[0][:160]}). "
                    "Do not load it; find out who wrote it"
                ) from None
        if self.expect is not None:
            if manifest.get("run_id") is None and isinstance(manifest.get("init_from"), dict):
                log.info(
                    "checkpoint %s is a warm start from %s (init_from without a destination identity); "
                    "run %s stage %s takes it over",
                    step_dir(step),
                    manifest["init_from"].get("uri"),
                    self.expect.run_id,
                    self.expect.stage,
                )
            elif (why := self.expect.mismatch(manifest)) is not None:
                raise self._refused(
                    step,
                    why,
                    "Resume it with the run, stage and spec that wrote it, or start "
                    "from it on purpose (Checkpointer.init_from)",
                )
        self.check_signature(step, manifest)
        ts = state.get("train_state")
        if isinstance(ts, dict) and "step" in ts and ts["step"] != step:
            raise self._refused(
                step,
                f"its state is at step {ts['step']!r} but its manifest says {step} (renamed or tampered)",
                "Find out who changed it",
            )
        return state

    def load(self, step: int) -> dict[str, Any]:
        """Verify names, links and checksums, then load every entry with weights_only=True and check
        the identity (CheckpointError if not valid, CheckpointRefused if not safe or not ours)."""
        return self._load_checked(step, *self._verified_bytes(step))

    def load_latest(self) -> tuple[int, dict[str, Any]] | None:
        """(step, state) of the newest valid checkpoint, reading each file once; None if there is none.

        A newest checkpoint whose checksums fail is skipped with a warning (a torn write);
        one that is refused raises :class:`CheckpointRefused` (see the module docstring).
        """
        skipped = []
        found = None
        for step in reversed(self.list_steps()):
            try:
                manifest, blobs = self._verified_bytes(step)
            except CheckpointRefused:
                raise
            except CheckpointError as e:
                skipped.append((step, str(e)))
                continue
            found = step, self._load_checked(step, manifest, blobs)
            break
        skipped += self.unreadable_after(found[0] if found else None).items()
        for step, reason in sorted(skipped, reverse=True):
            log.warning("checkpoint %s skipped: %s", step_dir(step), reason)
            if self.on_fallback is not None:
                self.on_fallback(self.storage.uri(step_dir(step)), reason)
        return found

    # ------------------------------------------------------------------ deliberate warm start
    def init_from(self, src_uri: str, step: int | None = None) -> int:
        """Start this location from another location's checkpoint, on purpose; return its step.

        The newest valid checkpoint under ``src_uri`` (or ``step``) is checked as a load would
        check it (names, links, checksums, weights-only, step), then copied here as this
        location's newest (newer steps here are removed first), manifest last. The manifest is
        re-stamped with this Checkpointer's identity and records the source under ``init_from``;
        the source's MLflow run id is not carried over. Built without an identity, the copy is an
        unclaimed warm start: the first run that resumes it takes it over.

        >>> import tempfile, torch
        >>> a, b = tempfile.mkdtemp(), tempfile.mkdtemp()
        >>> Checkpointer("file://" + a, async_save=False).save(5, {"model": {"w": torch.ones(1)}})
        True
        >>> Checkpointer("file://" + b).init_from("file://" + a)
        5
        """
        self.wait()
        src = Checkpointer(src_uri, async_save=False, key=self.key)
        step = src.find_latest() if step is None else step
        if step is None:
            raise ValueError(f"no valid checkpoint under {src_uri}; the source has not checkpointed yet")
        manifest, blobs = src._verified_bytes(step)
        src._load_checked(step, manifest, blobs)  # what a resume would refuse is not copied
        name = step_dir(step)
        for entry in self.storage.listdir():
            m = _STEP_DIR.match(entry)
            if m and int(m.group(1)) >= step:
                self.storage.rm(entry)
        origin = {k: manifest.get(k) for k in ("run_id", "stage", "fingerprint", "spec_hash")}
        blob = self._manifest_blob(
            {
                "format": 1,
                "step": step,
                "created": time.time(),
                "files": manifest["files"],
                "metrics": manifest.get("metrics") or {},
                "init_from": {"uri": src.storage.uri(name), "step": step, **origin},
            }
        )
        for fname, data in blobs.items():
            self.storage.write_bytes(f"{name}/{fname}", data)  # local: temp name + rename, links replaced
        self.storage.write_bytes(f"{name}/{MANIFEST}", blob)
        self.last_saved_step = step
        return step
