"""Checkpoint storage behind a small interface taking ``str`` URIs (file://, s3://, memory://).

Credentials come from the environment (AWS_* for s3) and never pass through here as
arguments, so they cannot reach a log line. Transient errors are retried with backoff.
"""
from __future__ import annotations

import errno
import logging
import os
import random
import time
from typing import Callable, TypeVar

import fsspec

log = logging.getLogger(__name__)
T = TypeVar("T")

# Not worth retrying: a full disk or a permission error only delays the clear error.
_PERMANENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS,
                     errno.EISDIR, errno.ENOTDIR}
# S3 error codes that mean "the service, not your request": retry.
_TRANSIENT_S3_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout",
                       "RequestTimeTooSkewed", "500", "502", "503", "504"}


def is_transient(e: BaseException) -> bool:
    """Whether an error from a storage call is the network or the endpoint (retry) rather than us.

    botocore/aiohttp errors do not derive from the builtin ConnectionError, so they are
    recognised by class name; an endpoint that is down raises EndpointConnectionError.
    """
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    if isinstance(e, OSError):
        return e.errno not in _PERMANENT_ERRNOS
    names = {c.__name__ for c in type(e).__mro__}
    module = type(e).__module__ or ""
    if module.startswith(("botocore", "aiobotocore")):
        if names & {"ConnectionError", "HTTPClientError", "ConnectionClosedError", "ReadTimeoutError",
                    "ConnectTimeoutError", "EndpointConnectionError", "ResponseStreamingError"}:
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


class Storage:
    """A directory tree at a URI."""

    def __init__(self, root_uri: str, retries: int = 6, base_delay_s: float = 0.5):
        self.root = root_uri.rstrip("/")
        # Importing a backend can draw from the global Python RNG (aiobotocore does); a training
        # process has seeded it already, and exact resume needs it untouched.
        rng_state = random.getstate()
        try:
            self.fs, self._root_path = fsspec.core.url_to_fs(self.root, **storage_options(self.root))
        finally:
            random.setstate(rng_state)
        self._jitter = random.Random()  # backoff jitter must not advance the global RNG either
        self.retries, self.base_delay_s = retries, base_delay_s
        self.is_local = self.fs.protocol in ("file", "local") or "file" in tuple(self.fs.protocol)

    def _path(self, rel: str = "") -> str:
        return f"{self._root_path}/{rel.strip('/')}" if rel else self._root_path

    def retry(self, what: str, fn: Callable[[], T]) -> T:
        """Call ``fn``; on a transient error retry with exponential backoff and jitter."""
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - anything not transient is re-raised at once
                if not is_transient(e) or attempt == self.retries:
                    raise
                delay = self.base_delay_s * 2 ** attempt * (0.5 + self._jitter.random())
                log.warning("storage: %s failed (%s: %s); retry %d/%d in %.1fs",
                            what, type(e).__name__, str(e).splitlines()[0][:200], attempt + 1, self.retries, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def makedirs(self, rel: str) -> None:
        if self.is_local:
            self.fs.makedirs(self._path(rel), exist_ok=True)

    def put_file(self, local_path: str, rel: str) -> None:
        self.retry(f"upload {rel}", lambda: self.fs.put_file(local_path, self._path(rel)))

    def write_bytes(self, rel: str, data: bytes) -> None:
        def write() -> None:
            with self.fs.open(self._path(rel), "wb") as f:
                f.write(data)
        self.retry(f"write {rel}", write)

    def read_bytes(self, rel: str) -> bytes:
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
