"""What every spec section is built from: the pydantic base model, the name check and the shared limits.

The bottom of the import graph: spec.py and every package's spec section (``sweepspec.py``,
``alerts/rules.py``, ``recipes/base.py``) import this module; it imports nothing of traingate.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

# Longer than any training job; a larger timeout overflows the waits it is passed to.
MAX_SECONDS = 366 * 24 * 3600.0
# numpy's RandomState (Optuna's samplers) takes seeds below 2**32; the runtime derives
# per-rank and per-epoch seeds from optim.seed, which must still fit torch's 64 bits.
MAX_SEED = 2**32 - 1
NAME_MAX = 64


def check_name(value: str, extra: str = "") -> str:
    """A name that becomes part of paths, MLflow names and Prefect limits: short, plain characters.

    >>> check_name("digits-demo_2")
    'digits-demo_2'
    """
    allowed = "._-" + extra
    if len(value) > NAME_MAX or not re.fullmatch(rf"[A-Za-z0-9][A-Za-z0-9{re.escape(allowed)}]*", value):
        raise ValueError(
            f"must be 1-{NAME_MAX} characters from A-Z a-z 0-9 {' '.join(allowed)}, starting with a "
            "letter or digit (it names paths and MLflow/Prefect objects); rename it"
        )
    return value


def number_kind(annotation: Any) -> str | None:
    """'number' for an int/float (optional) annotation, 'numbers' for a list of them, else None."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = {number_kind(a) for a in args if a is not type(None)}
        return kinds.pop() if len(kinds) == 1 else None
    if annotation in (int, float):
        return "number"
    if typing.get_origin(annotation) is list and len(args) == 1 and args[0] in (int, float):
        return "numbers"
    return None


def bool_for_number(annotation: Any, value: Any) -> str | None:
    """Why ``value`` is refused for a numeric field: YAML's true/false would silently count as 1/0."""
    kind = number_kind(annotation)
    if kind == "number" and isinstance(value, bool):
        return f"{str(value).lower()} is a boolean, not a number; give a number"
    if kind == "numbers" and isinstance(value, list) and any(isinstance(v, bool) for v in value):
        return "true/false are booleans, not numbers; give numbers"
    return None


# A reference (traingate.secrets) stands for text that is checked where it is resolved.
_REF = re.compile(r"\$\{env:[A-Za-z_][A-Za-z0-9_]*\}")
# Schemes whose URLs name a host (or a bucket) to be reached.
NETWORK_SCHEMES = {"http", "https", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "hf", "ftp", "sftp"}


def url_problem(value: str, schemes: set[str] | frozenset[str] | None = None) -> str | None:
    """Why ``value`` is not a usable URL (its scheme, its host), or None. ``schemes``: those allowed.

    A part that holds a ``${env:NAME}`` reference is checked once resolved (traingate.secrets).

    >>> url_problem("https://hooks.slack.com/services/T0/B0/x", {"http", "https"}) is None
    True
    >>> url_problem("hooks.slack.com/services/x", {"http", "https"})
    'has no scheme; write it as http://... or https://...'
    >>> url_problem("https:///services/x", {"http", "https"})
    'has no host; write https://HOST/...'
    """
    if _REF.fullmatch(value):
        return None
    scheme, sep, rest = value.partition("://")
    allowed = sorted(schemes) if schemes else None
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        want = " or ".join(f"{s}://..." for s in allowed) if allowed and len(allowed) <= 3 else "scheme://..."
        return f"has no scheme; write it as {want}"
    if allowed and scheme.lower() not in allowed and not _REF.search(scheme):
        return f"scheme {scheme}:// is not one of {', '.join(allowed)}; use one of those"
    if scheme.lower() in NETWORK_SCHEMES:
        netloc = re.split(r"[/?#]", rest, maxsplit=1)[0].rpartition("@")[2]
        host = netloc[1:].partition("]")[0] if netloc.startswith("[") else netloc.partition(":")[0]
        if not host:
            return f"has no host; write {scheme}://HOST/..."
        if not _REF.search(host) and not re.fullmatch(r"[A-Za-z0-9._:-]+", host):
            return f"host {host!r} is not a host name; fix it"
        port = netloc.rpartition(":")[2] if ":" in netloc and not netloc.endswith("]") else ""
        if port and not _REF.search(port) and not (port.isdigit() and 0 < int(port) < 65536):
            return f"port {port!r} is not a port number (1-65535); fix it"
    return None


def form_positions(schema: dict[str, Any]) -> None:
    """Number a model's JSON-schema properties in their declared order (``position``, from 0).

    A form built from the schema orders its fields by ``position`` (the Prefect UI's run form does): a
    schema kept as PostgreSQL JSONB (Prefect's deployments) comes back with its keys in another order.

    >>> schema = {"properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    >>> form_positions(schema)
    >>> schema["properties"]
    {'b': {'type': 'string', 'position': 0}, 'a': {'type': 'integer', 'position': 1}}
    """
    for i, prop in enumerate(schema.get("properties", {}).values()):
        prop["position"] = i


class SpecModel(BaseModel):
    """Base of every spec section (RunSpec's and every package's section).

    Unknown keys, inf/nan and booleans given for numbers are errors, not silent defaults. Its JSON
    schema numbers the fields in declared order (:func:`form_positions`).
    """

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, allow_inf_nan=False, json_schema_extra=form_positions
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: ValidationInfo) -> Any:
        why = bool_for_number(cls.model_fields[info.field_name].annotation, value) if info.field_name else None
        if why:
            raise ValueError(why)
        return value
