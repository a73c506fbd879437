"""Prefect's API clients in one process share one verified TLS context per CA file.

Every new Prefect client builds a verified ``ssl.SSLContext`` from its CA file (Prefect's
``PREFECT_API_SSL_CERT_FILE``, else certifi's bundle): 20-45 ms of CPU for the system bundle, whatever the
server's scheme. A ladder made five before its first stage: the command's own client, three async clients on
Prefect's event-loop thread, and the events client's version check. A verified context is not changed once made, and
OpenSSL's contexts serve many connections and threads, so one per CA file serves every client: :func:`install`
puts that in the Prefect modules that make them (the ladder's module does as it is imported); :func:`share`
also makes the context for the CA file Prefect is set to use now (an engine's preload: before it forks, so a
forked command makes none). A CA file changed on disk gets a new context; an unverified one (Prefect's
``PREFECT_API_TLS_INSECURE_SKIP_VERIFY``) is made anew each time, as Prefect makes it: its maker changes it.
"""

from __future__ import annotations

import importlib
import os
import ssl
import threading
from typing import Any

import certifi
from prefect.settings import PREFECT_API_SSL_CERT_FILE

_LOCK = threading.Lock()
_CONTEXTS: dict[tuple[str, int, int], ssl.SSLContext] = {}


def verified_context(cafile: str) -> ssl.SSLContext:
    """The process's verified client context for ``cafile`` as it is on disk now (made on first use)."""
    st = os.stat(cafile)
    key = (os.path.realpath(cafile), st.st_mtime_ns, st.st_size)
    with _LOCK:
        ctx = _CONTEXTS.get(key)
        if ctx is None:
            ctx = _CONTEXTS[key] = ssl.create_default_context(cafile=cafile)
    return ctx


class _SslSharingVerified:
    """The ``ssl`` module as Prefect's client module sees it: a verified context for a CA file is the shared one
    (:func:`verified_context`); everything else is ``ssl``'s own."""

    def __getattr__(self, name: str) -> Any:
        return getattr(ssl, name)

    @staticmethod
    def create_default_context(
        purpose: ssl.Purpose = ssl.Purpose.SERVER_AUTH,
        *,
        cafile: str | None = None,
        capath: str | None = None,
        cadata: str | bytes | None = None,
    ) -> ssl.SSLContext:
        if cafile is None or capath is not None or cadata is not None or purpose != ssl.Purpose.SERVER_AUTH:
            return ssl.create_default_context(purpose, cafile=cafile, capath=capath, cadata=cadata)
        return verified_context(cafile)


# Prefect's modules that make a client's verified context: its API clients', its events client's version check.
MAKERS = ("prefect.client.orchestration", "prefect._internal.version_checking")


def install() -> None:
    """Prefect's clients in this process take their verified context from :func:`verified_context`."""
    for name in MAKERS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:  # a Prefect that makes none there
            continue
        if not isinstance(getattr(module, "ssl", None), _SslSharingVerified):
            module.ssl = _SslSharingVerified()  # type: ignore[attr-defined]


def share() -> None:
    """:func:`install`, and the context for the CA file Prefect is set to use now made here (an engine's preload)."""
    install()
    verified_context(PREFECT_API_SSL_CERT_FILE.value() or certifi.where())
