"""Storage behind a small interface taking ``str`` URIs (file://, s3://, memory://), and what a failed
storage call means in one line (:func:`storage_failure`).

Credentials come from the environment (AWS_* for s3) and never pass through here as
arguments, so they cannot reach a log line. Transient errors are retried with backoff.

Paths are confined to the root: a relative path with a ``..`` or ``.`` component is refused.
On a local root, nothing below the root is reached through a symbolic link: reads refuse a
link (or anything but a plain file) and writes go to a fresh temporary name that is renamed
into place, so a link planted where a file is written is replaced, never written through.
The root itself may be a link (it is configuration, not content).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import secrets
import stat
import time
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, TypeVar

import fsspec

from traingate.secrets import resolve

log = logging.getLogger(__name__)
T = TypeVar("T")

# Not worth retrying: a full disk or a permission error only delays the clear error.
_PERMANENT_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.EISDIR,
    errno.ENOTDIR,
    errno.ELOOP,
}
# S3 error codes that mean "the service, not your request": retry.
_TRANSIENT_S3_CODES = {
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "500",
    "502",
    "503",
    "504",
}


class RefusedPath(OSError):
    """A path that leaves the storage root, goes through a symbolic link or is not a plain file."""


def is_transient(e: BaseException) -> bool:
    """Whether an error from a storage call is the network or the endpoint (retry) rather than us.

    botocore/aiohttp errors do not derive from the builtin ConnectionError, so they are
    recognised by class name; an endpoint that is down raises EndpointConnectionError.
    """
    if isinstance(e, (RefusedPath, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    if isinstance(e, OSError):
        return e.errno not in _PERMANENT_ERRNOS
    names = {c.__name__ for c in type(e).__mro__}
    module = type(e).__module__ or ""
    if module.startswith(("botocore", "aiobotocore")):
        if names & {
            "ConnectionError",
            "HTTPClientError",
            "ConnectionClosedError",
            "ReadTimeoutError",
            "ConnectTimeoutError",
            "EndpointConnectionError",
            "ResponseStreamingError",
        }:
            return True
        code = str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))
        return code in _TRANSIENT_S3_CODES
    if module.startswith("aiohttp"):
        return "ClientError" in names or "ServerDisconnectedError" in names
    return False


def storage_options(uri: str) -> dict:
    if uri.startswith("s3://"):
        endpoint = os.environ.get("TRAINGATE_S3_ENDPOINT_URL")
        opts: dict = {"skip_instance_cache": True}
        if endpoint:
            opts["client_kwargs"] = {"endpoint_url": endpoint}
        # Fail fast on a dead endpoint; our own retry loop does the waiting.
        opts["config_kwargs"] = {"connect_timeout": 2, "read_timeout": 10, "retries": {"max_attempts": 1}}
        return opts
    return {}


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *[p.strip("/") for p in parts]])


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def atomic_file(dir_fd: int, name: str) -> Iterator[BinaryIO]:
    """A new file that becomes ``name`` in the directory ``dir_fd`` once written and fsynced.

    It is created under a fresh random name (O_EXCL, O_NOFOLLOW), so neither a file nor a link
    already at ``name`` is opened: the rename replaces the directory entry, a link included,
    and never writes into what it points to. On an error the temporary file is removed.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, flags, 0o666, dir_fd=dir_fd)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)


def is_temporary(name: str) -> bool:
    """Whether a directory entry is an :func:`atomic_file` left behind by a killed writer."""
    return name.startswith(".") and name.endswith(".tmp")


class Storage:
    """A directory tree at a URI."""

    def __init__(self, root_uri: str, retries: int = 6, base_delay_s: float = 0.5):
        self.root = root_uri.rstrip("/")
        # A location may hold ${env:NAME} references (secrets stay out of spec and job files): the
        # filesystem gets them resolved; self.root, which is shown and recorded, keeps the reference.
        resolved = resolve(self.root, field="checkpoint location")
        # Importing a backend can draw from the global Python RNG (aiobotocore does); a training
        # process has seeded it already, and exact resume needs it untouched.
        rng_state = random.getstate()
        try:
            self.fs, self._root_path = fsspec.core.url_to_fs(resolved, **storage_options(resolved))
        finally:
            random.setstate(rng_state)
        self._jitter = random.Random()  # backoff jitter must not advance the global RNG either
        self.retries, self.base_delay_s = retries, base_delay_s
        self.is_local = self.fs.protocol in ("file", "local") or "file" in tuple(self.fs.protocol)

    def _parts(self, rel: str) -> list[str]:
        parts = [p for p in rel.strip("/").split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise RefusedPath(
                errno.EINVAL, f"{rel!r} is not a path inside {self.root}; '.' and '..' components are refused"
            )
        return parts

    def _path(self, rel: str = "") -> str:
        parts = self._parts(rel)
        return "/".join([self._root_path, *parts]) if parts else self._root_path

    # ---------------------------------------------------------------- local, links never followed
    def _open_dir(self, parts: list[str], create: bool = False) -> int:
        """An fd of root/parts, each component opened without following a link.

        ``create``: make missing directories, and replace a link found in the way by a real
        directory (the link is removed, its target is not touched).
        """
        if create:
            os.makedirs(self._root_path, exist_ok=True)
        fd = os.open(self._root_path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i, name in enumerate(parts):
                made = False
                if create:
                    try:
                        os.mkdir(name, dir_fd=fd)
                        made = True
                    except FileExistsError:
                        pass
                try:
                    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as e:
                    if e.errno not in (errno.ELOOP, errno.ENOTDIR) or not _is_link(fd, name):
                        raise
                    where = self.uri("/".join(parts[: i + 1]))
                    if not create:
                        raise RefusedPath(
                            errno.ELOOP,
                            f"{where} is a symbolic link ({os.readlink(name, dir_fd=fd)}); "
                            "it is not followed. Remove the link",
                        ) from None
                    log.warning(
                        "storage: %s was a symbolic link to %s; replaced by a directory, the target is untouched",
                        where,
                        os.readlink(name, dir_fd=fd),
                    )
                    os.unlink(name, dir_fd=fd)
                    os.mkdir(name, dir_fd=fd)
                    made = True
                    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                if made:
                    os.fsync(fd)  # the new directory entry is durable before anything is written below it
                os.close(fd)
                fd = sub
            return fd
        except BaseException:
            os.close(fd)
            raise

    @contextlib.contextmanager
    def local_dir(self, rel: str, create: bool = True) -> Iterator[int]:
        """A directory fd under a local root for :func:`atomic_file` writes (see ``_open_dir``)."""
        assert self.is_local, "local_dir is for file:// roots"
        fd = self._open_dir(self._parts(rel), create=create)
        try:
            yield fd
        finally:
            os.close(fd)

    def _read_local(self, rel: str) -> bytes:
        parts = self._parts(rel)
        dfd = self._open_dir(parts[:-1])
        try:
            # O_NONBLOCK: a FIFO planted here must not hang the reader; it is refused below.
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise RefusedPath(
                    errno.ELOOP,
                    f"{self.uri(rel)} is a symbolic link ({os.readlink(parts[-1], dir_fd=dfd)}); it is not followed",
                ) from None
            raise
        finally:
            os.close(dfd)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise RefusedPath(errno.EINVAL, f"{self.uri(rel)} is not a plain file; it is not read")
            return f.read()

    def _write_local(self, rel: str, data: bytes) -> None:
        parts = self._parts(rel)
        with self.local_dir("/".join(parts[:-1])) as dfd, atomic_file(dfd, parts[-1]) as f:
            f.write(data)

    def is_link(self, rel: str) -> bool:
        """Whether rel is a symbolic link (never, on an object store)."""
        return self.is_local and os.path.islink(self._path(rel))

    def retry(self, what: str, fn: Callable[[], T]) -> T:
        """Call ``fn``; on a transient error retry with exponential backoff and jitter."""
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - anything not transient is re-raised at once
                if not is_transient(e) or attempt == self.retries:
                    raise
                delay = self.base_delay_s * 2**attempt * (0.5 + self._jitter.random())
                log.warning(
                    "storage: %s failed (%s: %s); retry %d/%d in %.1fs",
                    what,
                    type(e).__name__,
                    str(e).splitlines()[0][:200],
                    attempt + 1,
                    self.retries,
                    delay,
                )
                time.sleep(delay)
        raise AssertionError("unreachable")

    def put_file(self, local_path: str, rel: str) -> None:
        self.retry(f"upload {rel}", lambda: self.fs.put_file(local_path, self._path(rel)))

    def write_bytes(self, rel: str, data: bytes) -> None:
        if self.is_local:
            return self.retry(f"write {rel}", lambda: self._write_local(rel, data))

        def write() -> None:
            with self.fs.open(self._path(rel), "wb") as f:
                f.write(data)

        self.retry(f"write {rel}", write)

    def read_bytes(self, rel: str) -> bytes:
        if self.is_local:
            return self.retry(f"read {rel}", lambda: self._read_local(rel))
        return self.retry(f"read {rel}", lambda: self.fs.cat_file(self._path(rel)))

    def exists(self, rel: str) -> bool:
        return self.retry(f"stat {rel}", lambda: self.fs.exists(self._path(rel)))

    def listdir(self, rel: str = "") -> list[str]:
        """Names directly under rel ([] when it does not exist)."""

        def ls() -> list[str]:
            try:
                self.fs.invalidate_cache(self._path(rel))
                entries = self.fs.ls(self._path(rel), detail=False)
            except FileNotFoundError:
                return []
            return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]

        return self.retry(f"list {rel}", ls)

    def rm(self, rel: str) -> None:
        def remove() -> None:
            try:
                self.fs.rm(self._path(rel), recursive=True)
            except FileNotFoundError:
                pass  # already gone: the goal state

        self.retry(f"remove {rel}", remove)

    def uri(self, rel: str = "") -> str:
        return join(self.root, rel) if rel else self.root


def storage_failure(e: BaseException) -> str | None:
    """Why a storage call failed, and the fix, for a one-line SpecError; None if it is not a storage error."""
    module = type(e).__module__ or ""
    name = type(e).__name__
    if module.startswith(("botocore", "aiobotocore")):
        if name in ("NoCredentialsError", "PartialCredentialsError"):
            return "no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
        code = s3_code(e)
        if code:
            return f"S3 answered {code}; fix the URI, the bucket or the credentials"
        return f"the S3 endpoint cannot be reached ({name}); check TRAINGATE_S3_ENDPOINT_URL and the network"
    if isinstance(e, PermissionError):
        return "permission denied; fix its permissions or the credentials"
    if isinstance(e, NotADirectoryError):
        return "part of the path is a file, not a directory; fix the location"
    if isinstance(e, IsADirectoryError):
        return "is a directory; point it at a file"
    if isinstance(e, ImportError):
        return f"no filesystem for it is installed ({e}); install it or use file:// or s3://"
    if isinstance(e, ValueError) and "protocol" in str(e).lower():
        return f"{e}; use a file://, s3:// or https:// URI"
    if module.startswith("aiohttp"):
        return f"cannot be reached ({name}); fix the URI or the network"
    if isinstance(e, OSError):
        return f"cannot be read ({e.strerror or name}); fix the location"
    return None


def s3_code(e: Any) -> str:
    """The S3 error code a botocore error carries ("" when none)."""
    return str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))
