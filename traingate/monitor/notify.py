"""The optional alert webhook (``alerts.webhook_url``): each alert POSTed as JSON, off the supervisor's thread.

The URL is usually a secret (a Slack or Teams incoming webhook carries its token in the path), so the
spec holds ``${env:NAME}`` and the URL is resolved here, in memory, when a message is sent; a failure
is logged without it. Prefect Automations on the ``traingate.alert.*`` events are the other way to be
told (deployments/automations/alerts.yaml).
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from traingate.redact import redact_tree
from traingate.secrets import resolve

log = logging.getLogger(__name__)
TIMEOUT_S = 10.0
# Posts leave in the order the alerts were raised: each sender waits for the one before it (a loss
# spike and the gradient-norm alert it causes at the same step must not reach the channel swapped).
_order = threading.Lock()
_last: threading.Thread | None = None


def post(url_ref: str, payload: dict[str, Any], say: Callable[[str], None] = log.warning) -> threading.Thread:
    """POST ``payload`` to the URL ``url_ref`` resolves to, in a daemon thread (returned, for tests).

    It is sent after every post before it has been answered or has failed.
    """

    def send() -> None:
        host = "the alert webhook"
        try:
            url = resolve(url_ref, field="alerts.webhook_url")
            host = f"the alert webhook on {urlsplit(url).hostname}"
            body = json.dumps({"text": payload.get("message", ""), **redact_tree(payload)}).encode()
            req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
                r.read()
        except urllib.error.HTTPError as e:
            say(f"{host} answered HTTP {e.code}; the alert is in alerts.jsonl and the run's logbook")
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", None) or type(e).__name__
            say(f"{host} not reached ({reason}); the alert is in alerts.jsonl and the run's logbook")

    global _last
    with _order:
        before = _last

        def in_order() -> None:
            if before is not None:
                before.join(TIMEOUT_S + 1)
            send()

        t = _last = threading.Thread(target=in_order, name="alert-webhook", daemon=True)
        t.start()
    return t
