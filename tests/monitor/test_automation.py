"""The shipped Prefect Automations (deployments/automations/alerts.yaml) on a real server.

The session's Prefect server (a real server with its triggers and actions services), a real Custom
Webhook notification block pointing at an HTTP endpoint this test serves on loopback, the automations
created with `prefect automation create --from-file` exactly as the file's header tells a user; then
the events traingate's launch task emits for a critical alert and for a warning: the critical one
reaches the webhook with the alert's message, the warning does not. The automations and the block are
deleted afterwards: later tests on the same server emit alerts of their own.
"""
from __future__ import annotations

import asyncio
import json
import os
import queue
import secrets
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from tgtest import PYTHON, ROOT, free_port, prefect_api_at

pytestmark = pytest.mark.slow


def _webhook() -> tuple[HTTPServer, "queue.Queue[dict]"]:
    got: "queue.Queue[dict]" = queue.Queue()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            got.put(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = HTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, got


def test_the_shipped_automation_notifies_a_critical_alert_and_not_a_warning(prefect_api, tmp_path):
    import yaml
    from prefect import get_client
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    hook, received = _webhook()
    server = {"url": prefect_api["PREFECT_API_URL"],
              "env": {**os.environ, **prefect_api, "PREFECT_HOME": str(tmp_path / "prefect-home")}}
    text = (ROOT / "deployments" / "automations" / "alerts.yaml").read_text()
    shipped = [a["name"] for a in yaml.safe_load(text)["automations"]]
    block_name = f"tg-test-{secrets.token_hex(3)}"
    with prefect_api_at(server["url"]):
        block_id = CustomWebhookNotificationBlock(
            name="tg-test", url=f"http://127.0.0.1:{hook.server_port}/notify", method="POST",
            json_data={"subject": "{{subject}}", "body": "{{body}}"}).save(block_name)
        try:
            spec = tmp_path / "alerts.yaml"
            spec.write_text(text.replace("00000000-0000-0000-0000-000000000000", str(block_id)))
            made = subprocess.run([str(Path(PYTHON).parent / "prefect"), "automation", "create", "-f", str(spec)],
                                  env=server["env"], capture_output=True, text=True, timeout=120)
            assert made.returncode == 0, made.stdout + made.stderr

            def emit(rule: str, severity: str) -> None:
                # Its own events client on this server: emit_event would reuse the process's events worker,
                # bound to whichever API the suite's earlier tests used first.
                from prefect.events import Event
                from prefect.events.clients import PrefectEventsClient

                async def send() -> None:
                    async with PrefectEventsClient(api_url=server["url"]) as events:
                        await events.emit(Event(
                            event=f"traingate.alert.{rule}",
                            resource={"prefect.resource.id": "traingate.run.r-123", "traingate.stage": "full",
                                      "traingate.severity": severity, "traingate.action": "rollback"},
                            payload={"rule": rule, "severity": severity, "outcome": "rolling back to step 30",
                                     "message": f"{rule}: the numbers [rollback; runbook docs/runbooks.md#{rule}]"}))
                asyncio.run(send())

            # The server's triggers service picks a new automation up a moment after it is created (longer
            # on a loaded machine): a critical alert is repeated until the first notification arrives.
            deadline, note = time.monotonic() + 180, None
            while note is None:
                assert time.monotonic() < deadline, "the critical alert reached no webhook within 180 s"
                emit("loss-spike", "critical")
                try:
                    note = received.get(timeout=10)
                except queue.Empty:
                    pass
            assert "loss-spike" in note["subject"] and "traingate.run.r-123" in note["subject"]
            assert note["body"].startswith("loss-spike: the numbers") and "rolling back to step 30" in note["body"]
            # The automation is live now: a warning matches none of it (late repeats of the critical may come).
            emit("stagnation", "warning")
            end = time.monotonic() + 10
            while (left := end - time.monotonic()) > 0:
                try:
                    late = received.get(timeout=left)
                except queue.Empty:
                    break
                assert "stagnation" not in late["subject"] + late["body"], late
        finally:
            with get_client(sync_client=True) as c:
                for automation in c.read_automations():
                    if automation.name in shipped:
                        c.delete_automation(automation.id)
                c.delete_block_document(block_id)
    hook.shutdown()
