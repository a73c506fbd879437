"""Fixtures for the runtime tests: a module-wide S3 endpoint on loopback (moto server mode)."""
from __future__ import annotations

import logging
import socket

import pytest

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing-key-id", "AWS_SECRET_ACCESS_KEY": "testing-secret-key-do-not-log",
          "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoEndpoint:
    """A real S3 HTTP endpoint that a test can take down and bring back on the same port."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server = None
        self.start()

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
        # moto keeps its buckets in process memory, so a restarted server serves the same objects.
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="module")
def s3_endpoint():
    """Module-wide S3 endpoint with bucket ``tg-test``; its settings are in os.environ for the module."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in S3_ENV.items():
            mp.setenv(k, v)
        moto = MotoEndpoint()
        mp.setenv("TRAINGATE_S3_ENDPOINT_URL", moto.endpoint)
        import boto3

        boto3.client("s3", endpoint_url=moto.endpoint).create_bucket(Bucket="tg-test")
        yield moto
        moto.stop()
