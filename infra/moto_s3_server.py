"""The native stack's object store: moto's server with moto's IAM checks on from the first request and
its control routes (``/moto-api/*``) refused.

    python infra/moto_s3_server.py -H 127.0.0.1 -p PORT

Environment (the stack passes them; none has a default):

- ``MINIO_ROOT_USER`` / ``MINIO_ROOT_PASSWORD``: the root key, the key of an IAM user allowed every
  action (MinIO's root user). The bucket/users setup (the compose file's create-bucket) uses it.
- ``TRAINGATE_S3_SERVICE_KEYS``: JSON ``{access key: secret key}``, one IAM user per service, named by its
  access key. The user has no rights until the setup attaches a policy to it (``mc admin policy attach``).

moto's IAM API creates access keys of its own choosing; MinIO's ``mc admin user add`` takes the caller's.
This server imports the stack's generated keys into moto's IAM at start, so the keys in the stack's 0600
secrets file are the ones the server accepts. Everything else is moto's own code: the SigV4 signature
check (an unknown key or a wrong signature is refused with 403) and the evaluation of the user's policies
on the S3 action and the bucket or object ARN (a key outside its policy is refused with 403).

Refused with 403 here, before moto:

- ``/moto-api/*`` (and the ``motoapi.amazonaws.com`` host): reset, reset-auth, seed, recorder, data.json
  would let any client switch the checks off, wipe the store or read every key and object.
- a request without an ``Authorization`` header: moto would serve public objects to it, and with its IAM
  checks on it cannot check a presigned URL (a signature in the query string). The stack's clients sign
  in the header; MLflow's clients are told to download through the tracking server instead of from the
  presigned URLs it hands out (``local_stack.NATIVE_S3_CLIENT_ENV``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"  # read by moto.settings at import

from moto import settings  # noqa: E402
from moto.core import DEFAULT_ACCOUNT_ID  # noqa: E402
from moto.iam.models import iam_backends  # noqa: E402
from moto.moto_server.werkzeug_app import (  # noqa: E402
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import run_simple  # noqa: E402

ROOT_POLICY = json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]})
FORBIDDEN = b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code><Message>%s</Message></Error>"


def import_user(name: str, access_key: str, secret_key: str, policy: str | None = None) -> None:
    """An IAM user ``name`` whose one access key is ``access_key``/``secret_key`` (and ``policy`` inline)."""
    iam = iam_backends[DEFAULT_ACCOUNT_ID]["aws"]
    iam.create_user("us-east-1", name, path="/", tags=[])
    key = iam.create_access_key(name)
    del iam.access_keys[key.physical_resource_id]
    key.access_key_id, key.secret_access_key = access_key, secret_key
    iam.access_keys[key.physical_resource_id] = key
    if policy:
        iam.put_user_policy(name, "root", policy)


class ControlRoutesRefused:
    """The WSGI app: moto's, less its control routes and unsigned requests."""

    def __init__(self, app: Any):
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        path = "/" + environ.get("PATH_INFO", "").lstrip("/")
        host = environ.get("HTTP_HOST", "")
        if path.startswith("/moto-api") or path == "/favicon.ico" or host.startswith("motoapi."):
            return self.refuse(start_response, b"moto's control routes are not served here")
        if "HTTP_AUTHORIZATION" not in environ:
            return self.refuse(start_response, b"sign the request with an access key (SigV4, Authorization header)")
        return self.app(environ, start_response)

    @staticmethod
    def refuse(start_response: Any, why: bytes) -> list[bytes]:
        body = FORBIDDEN % why
        start_response("403 Forbidden", [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
        return [body]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moto_s3_server", description=__doc__.split("\n\n")[0])
    ap.add_argument("-H", "--host", default="127.0.0.1")
    ap.add_argument("-p", "--port", type=int, required=True)
    args = ap.parse_args(argv)
    root_key, root_secret = os.environ.get("MINIO_ROOT_USER", ""), os.environ.get("MINIO_ROOT_PASSWORD", "")
    if not root_key or not root_secret:
        print("moto_s3_server: set MINIO_ROOT_USER and MINIO_ROOT_PASSWORD (the root key)", file=sys.stderr)
        return 2
    try:
        services = json.loads(os.environ.get("TRAINGATE_S3_SERVICE_KEYS", "{}"))
    except ValueError as e:
        print(f"moto_s3_server: TRAINGATE_S3_SERVICE_KEYS is not JSON {{access key: secret key}}: {e}", file=sys.stderr)
        return 2
    os.environ["MOTO_ACCOUNT_ID"] = DEFAULT_ACCOUNT_ID  # one account: no client picks another with a header
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
    import_user("root", root_key, root_secret, ROOT_POLICY)
    for key, secret in services.items():
        import_user(key, key, secret)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(args.host, args.port, ControlRoutesRefused(app), threaded=True, request_handler=MotoRequestHandler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
