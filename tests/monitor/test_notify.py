"""The alert webhook: a real HTTP endpoint on loopback; the URL (a secret) comes from the environment."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from tgtest import free_port
from traingate.monitor import notify


@pytest.fixture(autouse=True)
def _hook_allowed(monkeypatch):
    """The operator allows specs to name the webhook variable (TRAINGATE_ENV_ALLOW)."""
    monkeypatch.setenv("TRAINGATE_ENV_ALLOW", "TG_HOOK")


def _server(status: int = 200):
    got: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            got.append({"path": self.path, "body": json.loads(self.rfile.read(int(self.headers["Content-Length"])))})
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = HTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, got


def test_an_alert_is_posted_as_json_to_the_url_the_environment_holds(monkeypatch):
    server, got = _server()
    monkeypatch.setenv("TG_HOOK", f"http://127.0.0.1:{server.server_port}/hooks/T0K3N-secret")
    said: list[str] = []
    notify.post("${env:TG_HOOK}", {"rule": "loss-spike", "message": "loss-spike: 9 at step 34"}, said.append).join(10)
    server.shutdown()
    assert got[0]["path"] == "/hooks/T0K3N-secret"
    assert got[0]["body"]["text"] == "loss-spike: 9 at step 34" and got[0]["body"]["rule"] == "loss-spike"
    assert said == []


def test_a_failing_webhook_is_one_line_without_its_secret_url(monkeypatch):
    server, _ = _server(status=500)
    monkeypatch.setenv("TG_HOOK", f"http://127.0.0.1:{server.server_port}/hooks/T0K3N-secret")
    said: list[str] = []
    notify.post("${env:TG_HOOK}", {"message": "x"}, said.append).join(10)
    server.shutdown()
    monkeypatch.setenv("TG_HOOK", f"http://127.0.0.1:{free_port()}/hooks/T0K3N-secret")  # nobody listens
    notify.post("${env:TG_HOOK}", {"message": "x"}, said.append).join(10)
    monkeypatch.delenv("TG_HOOK")
    notify.post("${env:TG_HOOK}", {"message": "x"}, said.append).join(10)
    assert said[0] == "the alert webhook on 127.0.0.1 answered HTTP 500; the alert is in alerts.jsonl and the run's logbook"
    assert said[1].startswith("the alert webhook on 127.0.0.1 not reached (")
    assert said[2].startswith("the alert webhook not reached (")
    assert not any("T0K3N" in line for line in said)


def test_alerts_reach_the_channel_in_the_order_they_were_raised(monkeypatch):
    # The first answer takes 0.5 s and a threaded server records each post after answering it: posts
    # sent side by side would be recorded second-first.
    import time
    from http.server import ThreadingHTTPServer

    got: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            rule = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["rule"]
            if rule == "loss-spike":
                time.sleep(0.5)
            self.send_response(200)
            self.end_headers()
            got.append(rule)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("TG_HOOK", f"http://127.0.0.1:{server.server_port}/hook")
    notify.post("${env:TG_HOOK}", {"rule": "loss-spike", "message": "a"}, print)
    notify.post("${env:TG_HOOK}", {"rule": "grad-norm-explosion", "message": "b"}, print).join(10)
    server.shutdown()
    assert got == ["loss-spike", "grad-norm-explosion"]
