"""Keep secrets out of params, tags, artifacts and logs.

>>> redact("s3://AKIA:hunter2@bucket/x")
's3://AKIA:***@bucket/x'
>>> redact_mapping({"aws_secret_access_key": "abc", "lr": "0.1"})
{'aws_secret_access_key': '***', 'lr': '0.1'}
"""
from __future__ import annotations

import os
import re
from typing import Any, Mapping

_URL_PASSWORD = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/@\s]+):(?P<pw>[^@\s/]+)@")
_SECRET_KEY = re.compile(r"(secret|password|passwd|token|api[_-]?key|credential|private[_-]?key)", re.I)
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "MLFLOW_TRACKING_PASSWORD",
               "MLFLOW_TRACKING_TOKEN", "PREFECT_API_KEY")


def _env_secrets() -> list[str]:
    return [v for k in _SECRET_ENV if len(v := os.environ.get(k, "")) >= 4]


def redact(text: str) -> str:
    text = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
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
