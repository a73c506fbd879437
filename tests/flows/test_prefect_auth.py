"""Every Prefect server traingate or its test suite starts authenticates its clients: the temporary server a
command starts without PREFECT_API_URL (CI's default) and the session's server refuse an anonymous request on
every route of the API except health, and answer the clients given the auth string.

Real servers on loopback; the temporary server is started as `traingate run` starts it (the CLI's start-up,
then Prefect's own client) in a subprocess whose environment holds no auth string."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from tgtest import PYTHON, ROOT

# The routes and the anonymous walk, shared by the test process and the CLI-like subprocess.
WALK = r'''
import re
import httpx


def routes():
    """Every (method, path) of the Prefect server's API app, from its route table and its OpenAPI paths."""
    from prefect.server.api.server import create_api_app

    api = create_api_app(ignore_cache=True)
    found = {(m.upper(), path) for path, ops in api.openapi()["paths"].items() for m in ops}
    return sorted(found | {(m, r.path) for r in api.routes if getattr(r, "path", None)
                           for m in getattr(r, "methods", None) or {"GET"}})


def open_routes(base, headers=None):
    """The routes that answer an anonymous request with anything but 401, and how many were asked."""
    out, asked = {}, routes()
    with httpx.Client(base_url=base.rstrip("/"), timeout=60, headers=headers or {}) as h:
        for method, path in asked:
            url = re.sub(r"\{[^}]+\}", "00000000-0000-0000-0000-000000000000", path)
            status = h.request(method, url, json={} if method in ("POST", "PUT", "PATCH") else None).status_code
            if status != 401:
                out[f"{method} {path}"] = status
    return out, len(asked)
'''

TEMPORARY = (
    WALK
    + r"""
import json, os
from flows.cli.command import _embedded_defaults
from traingate.settings import Settings

_embedded_defaults(Settings.from_env())
from prefect import get_client

with get_client(sync_client=True) as c:  # starts Prefect's temporary server, as `traingate run` does
    api = str(c.api_url)
    c.read_flows(limit=1)  # the CLI's own client is let in
    opened, asked = open_routes(api)
    wrong = httpx.get(f"{api.rstrip('/')}/admin/version", auth=("traingate", "not-the-string")).status_code
print(json.dumps({"api": api, "open": opened, "asked": asked, "wrong": wrong}))
"""
)


def _walk() -> dict:
    scope: dict = {}
    exec(compile(WALK, "walk", "exec"), scope)  # one definition for both sides of the test
    return scope


@pytest.mark.slow  # a CLI start-up and a temporary Prefect server: 15-40 s on a loaded 2-core box
@pytest.mark.timeout(600)
def test_the_temporary_server_of_a_command_refuses_an_anonymous_client_on_every_route_except_health(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PREFECT_SERVER_API"))}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect"),
        TRAINGATE_STATE_DIR=str(tmp_path / "state"),
        TRAINGATE_PREFECT_SERVER="temporary",
    )
    p = subprocess.run([PYTHON, "-c", TEMPORARY], cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/api/?", out["api"]), out["api"]
    assert out["asked"] > 150, out
    assert out["open"] == {"GET /health": 200, "GET /ready": 200}, out["open"]
    assert out["wrong"] == 401


def test_the_sessions_prefect_server_refuses_an_anonymous_client_on_every_route_except_health(prefect_api):
    import httpx

    api = prefect_api["PREFECT_API_URL"]
    assert (
        httpx.get(f"{api}/admin/version", auth=tuple(prefect_api["PREFECT_API_AUTH_STRING"].split(":", 1))).status_code
        == 200
    )
    opened, asked = _walk()["open_routes"](api)
    assert asked > 150
    assert opened == {"GET /health": 200, "GET /ready": 200}, opened
