"""Storage against a real S3 endpoint on loopback (moto server), taken down and brought back."""
from __future__ import annotations

import errno
import logging
import threading
import time

import pytest

from traingate.storage import Storage, is_transient


def test_an_s3_outage_is_retried_with_backoff_until_the_endpoint_is_back(s3_endpoint, caplog):
    st = Storage("s3://tg-test/storage-test", base_delay_s=0.2)
    st.write_bytes("a/before", b"1")
    s3_endpoint.stop()
    back = threading.Timer(2.0, s3_endpoint.start)
    back.start()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="traingate.storage"):
        st.write_bytes("a/during", b"2")  # blocks through the outage
    back.join()
    assert time.monotonic() - t0 >= 2.0
    assert st.read_bytes("a/during") == b"2" and st.read_bytes("a/before") == b"1"
    retries = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert retries and "EndpointConnectionError" in retries[0]
    assert "testing-secret-key-do-not-log" not in caplog.text


def test_storage_gives_up_after_its_retries_when_the_endpoint_stays_down(s3_endpoint):
    st = Storage("s3://tg-test/storage-test", retries=2, base_delay_s=0.05)
    s3_endpoint.stop()
    try:
        with pytest.raises(Exception) as err:
            st.write_bytes("b/x", b"x")
        assert is_transient(err.value)
    finally:
        s3_endpoint.start()


def test_errors_of_our_own_making_are_not_retried():
    from botocore.exceptions import ClientError, EndpointConnectionError

    assert is_transient(ConnectionRefusedError()) and is_transient(TimeoutError())
    assert is_transient(EndpointConnectionError(endpoint_url="http://x"))
    assert is_transient(ClientError({"Error": {"Code": "SlowDown"}}, "PutObject"))
    assert not is_transient(ClientError({"Error": {"Code": "NoSuchBucket"}}, "PutObject"))
    assert not is_transient(OSError(errno.ENOSPC, "No space left on device"))
    assert not is_transient(FileNotFoundError("gone")) and not is_transient(ValueError("bug"))


def test_a_missing_file_fails_at_once(tmp_path):
    st = Storage(tmp_path.as_uri())
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError):
        st.read_bytes("nope")
    assert time.monotonic() - t0 < 1.0
    assert st.listdir("nope") == []
