"""Keep secrets out of params, tags, artifacts and logs.

>>> redact("s3://AKIA:hunter2@bucket/x")
's3://AKIA:***@bucket/x'
>>> redact("postgresql://optuna:pw@db/x?sslmode=require&password=hunter2")
'postgresql://optuna:***@db/x?sslmode=require&password=***'
>>> redact_mapping({"aws_secret_access_key": "abc", "lr": "0.1"})
{'aws_secret_access_key': '***', 'lr': '0.1'}
"""
from __future__ import annotations

import logging
import os
import re
from typing import Any, Mapping

_URL_PASSWORD = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/@\s]+):(?P<pw>[^@\s/]+)@")
# `password=...`, `token: ...` in query strings, command lines and config dumps.
_KEY_VALUE = re.compile(
    r"(?P<key>\b[\w.-]*(?:secret|password|passwd|token|api[_-]?key|access[_-]?key|secret[_-]?key|private[_-]?key"
    r"|credentials?)[\"']?)(?P<sep>\s*[=:]\s*)(?P<quote>[\"']?)(?P<value>[^\s&\"',;}]+)", re.I)
_SECRET_KEY = re.compile(r"(secret|password|passwd|token|api[_-]?key|credential|private[_-]?key)", re.I)
_SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "MLFLOW_TRACKING_PASSWORD",
               "MLFLOW_TRACKING_TOKEN", "PREFECT_API_KEY")


def _env_secrets() -> list[str]:
    # Short values would blank out ordinary words; real keys and tokens are 16+ characters.
    return [v for k in _SECRET_ENV if len(v := os.environ.get(k, "")) >= 8]


def redact(text: str) -> str:
    text = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
    text = _KEY_VALUE.sub(lambda m: f"{m['key']}{m['sep']}{m['quote']}***", text)
    for secret in _env_secrets():
        text = text.replace(secret, "***")
    return text


def redact_mapping(d: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if _SECRET_KEY.search(str(k)):
            out[k] = "***"
        elif isinstance(v, Mapping):
            out[k] = redact_mapping(v)
        elif isinstance(v, str):
            out[k] = redact(v)
        else:
            out[k] = v
    return out


class RedactingFilter(logging.Filter):
    """A logging filter that redacts every record's message (install it on the handlers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        clean = redact(msg)
        if clean != msg:
            record.msg, record.args = clean, None
        return True
