"""Prefect's clients in one process share one verified TLS context per CA file (flows.prefect_tls): a client made
in another thread, an async one, the events client's version check all take it; it still verifies; a CA file
changed on disk gets a new one; an unverified context is never shared. No server: the clients are only made."""

from __future__ import annotations

import shutil
import ssl
import threading

import certifi
import pytest
from prefect.client.orchestration import PrefectClient, SyncPrefectClient

from flows import prefect_tls


def _context_of(client: PrefectClient | SyncPrefectClient) -> ssl.SSLContext:
    return client._client._transport._pool._ssl_context  # httpx's transport: the context it connects with


@pytest.fixture
def made(monkeypatch):
    """Every context the ``ssl`` module makes from now on, with the CA file it was made from."""
    calls: list[str | None] = []
    real = ssl.create_default_context

    def spy(*args, **kwargs):
        calls.append(kwargs.get("cafile"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", spy)
    return calls


def test_clients_of_one_process_share_one_verified_context_made_once(made):
    prefect_tls.share()
    before = len(made)
    url = "http://127.0.0.1:9/api"  # never reached: a client is only made
    clients = [SyncPrefectClient(url), PrefectClient(url)]
    in_thread = threading.Thread(target=lambda: clients.append(SyncPrefectClient(url)))
    in_thread.start()
    in_thread.join()
    contexts = {id(_context_of(c)) for c in clients}
    assert len(contexts) == 1 and len(made) == before  # one context, made by share() before any client
    shared = _context_of(clients[0])
    assert shared.verify_mode == ssl.CERT_REQUIRED and shared.check_hostname  # it verifies...
    assert shared.get_ca_certs()  # ...against the CA file's certificates


def test_the_events_clients_version_check_takes_the_shared_context_too(made):
    from prefect._internal import version_checking

    prefect_tls.install()
    assert version_checking.ssl.create_default_context(cafile=certifi.where()) is prefect_tls.verified_context(
        certifi.where()
    )


def test_a_ca_file_changed_on_disk_gets_a_new_context(tmp_path):
    cafile = tmp_path / "ca.pem"
    shutil.copy(certifi.where(), cafile)
    first = prefect_tls.verified_context(str(cafile))
    assert prefect_tls.verified_context(str(cafile)) is first
    with open(cafile, "a") as f:
        f.write("\n")  # the same certificates, a new file
    assert prefect_tls.verified_context(str(cafile)) is not first


def test_an_unverified_context_is_made_anew_and_never_shared(monkeypatch):
    from prefect.client import orchestration

    prefect_tls.install()
    monkeypatch.setattr(orchestration, "PREFECT_API_TLS_INSECURE_SKIP_VERIFY", True)  # as the setting reads
    a, b = SyncPrefectClient("https://127.0.0.1:9/api"), SyncPrefectClient("https://127.0.0.1:9/api")
    assert _context_of(a) is not _context_of(b)
    assert _context_of(a).verify_mode == ssl.CERT_NONE
    assert prefect_tls.verified_context(certifi.where()).verify_mode == ssl.CERT_REQUIRED  # the shared one is not
