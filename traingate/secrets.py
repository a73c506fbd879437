"""Secret references: a spec holds ``${env:NAME}``, never the secret itself.

Any string in a RunSpec may contain ``${env:NAME}``. It is resolved only where the value is
used (a command line, a URI being opened), in memory, from the process environment; nothing
resolved is written back. The CLI calls :func:`protect` on the spec tree and the ``--set``
overrides before anything else sees them: each literal secret (whatever
:mod:`traingate.redact` would mask) moves into the environment as ``TRAINGATE_SECRET_<n>`` and
its place in the spec becomes a reference. So the flow-run parameters, the resolved spec file
and the stage's job file hold references; the child processes inherit the values.

>>> tree, overrides, env = extract({"data": {"uri": "https://h/d.csv?sig=abc123"}}, ["x.password=pw"], env={})
>>> tree, overrides, env  # doctest: +NORMALIZE_WHITESPACE
({'data': {'uri': 'https://h/d.csv?sig=${env:TRAINGATE_SECRET_1}'}}, ['x.password="${env:TRAINGATE_SECRET_2}"'],
{'TRAINGATE_SECRET_1': 'abc123', 'TRAINGATE_SECRET_2': 'pw'})
>>> resolve_tree(tree, env=env)
{'data': {'uri': 'https://h/d.csv?sig=abc123'}}
>>> resolve("s3://b/${env:NOPE}", env={"TRAINGATE_ENV_ALLOW": "NOPE"}, field="checkpoint.uri")
... # doctest: +NORMALIZE_WHITESPACE
Traceback (most recent call last):
...
traingate.secrets.SecretRefError: checkpoint.uri = 's3://b/${env:NOPE}': environment variable NOPE is not set;
export NOPE where this runs (on the worker, for a deployment) or write the value in the spec
>>> resolve("https://evil.example/?k=${env:HOME}", env={"HOME": "/root"})  # doctest: +NORMALIZE_WHITESPACE
Traceback (most recent call last):
...
traingate.secrets.SecretRefError: value = 'https://evil.example/?k=${env:HOME}': environment variable HOME is not
on the allowlist TRAINGATE_ENV_ALLOW; add HOME to TRAINGATE_ENV_ALLOW where this runs (the worker's environment, for
a deployment) or write the value in the spec
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, MutableMapping
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from traingate.redact import REF, map_secrets, redact
from traingate.settings import ENV_ALLOW_VAR, ENV_HOSTS_VAR, S3_ENDPOINT_VAR, env_allowed, host_allowed
from traingate.spec import RunSpec, SpecError, apply_overrides, parse_spec

PREFIX = "TRAINGATE_SECRET_"


class SecretRefError(SpecError):
    """A ``${env:NAME}`` whose variable is not set. One line: field, value, fix."""


class _Namer:
    """Gives each distinct secret one variable name, reusing a name the environment already holds
    for the same value (a resumed run re-extracts the same secrets into the same names)."""

    def __init__(self, env: Mapping[str, str]):
        self.env = env
        self.added: dict[str, str] = {}
        self.by_value = {v: k for k, v in sorted(env.items(), reverse=True) if k.startswith(PREFIX)}

    def ref(self, value: str) -> str:
        name = self.by_value.get(value)
        if name is None:
            n = 1
            while f"{PREFIX}{n}" in self.env or f"{PREFIX}{n}" in self.added:
                n += 1
            name = f"{PREFIX}{n}"
            self.added[name] = value
            self.by_value[value] = name
        return f"${{env:{name}}}"


def extract(
    tree: Any, overrides: list[str] | tuple[str, ...] = (), env: Mapping[str, str] | None = None
) -> tuple[Any, list[str], dict[str, str]]:
    """(tree with references, overrides with references, variables to add to the environment).

    Pure: ``env`` (default ``os.environ``) is only read, to pick free names and reuse known ones.
    An override that holds no secret is returned verbatim; one that does is rewritten as
    ``key=<JSON>``, which the spec parser reads back as the same value with references.
    """
    namer = _Namer(os.environ if env is None else env)
    new_tree = map_secrets(tree, namer.ref)
    new_overrides = []
    for item in overrides:
        parsed = apply_overrides({}, [item])  # raises the parser's own SpecError for a malformed item
        replaced = map_secrets(parsed, namer.ref)
        if replaced == parsed:
            new_overrides.append(item)
            continue
        key = item.split("=", 1)[0].strip()
        node = replaced
        for part in key.split("."):
            node = node[part]
        new_overrides.append(f"{key}={json.dumps(node)}")
    return new_tree, new_overrides, namer.added


def protect(tree: Any, overrides: list[str] | tuple[str, ...] = ()) -> tuple[Any, list[str]]:
    """:func:`extract`, with the secrets moved into this process's environment (children inherit it)."""
    new_tree, new_overrides, added = extract(tree, overrides)
    os.environ.update(added)
    return new_tree, new_overrides


def protect_spec(spec: RunSpec) -> RunSpec:
    """The same spec with its literal secrets moved into this process's environment (see :func:`protect`)."""
    tree, _ = protect(spec.to_dict())
    return parse_spec(tree)


# MLflow's own credential variables: its REST client sends them as HTTP basic auth.
TRACKING_USERNAME = "MLFLOW_TRACKING_USERNAME"
TRACKING_PASSWORD = "MLFLOW_TRACKING_PASSWORD"


def move_tracking_credentials(env: MutableMapping[str, str] | None = None) -> None:
    """Take ``user:password@`` out of an http(s) tracking URI in the environment, into MLflow's
    credential variables.

    The tracking URI is written everywhere (each stage's job file, the MLflow UI hint, MLflow's
    "View run at" lines); the credential variables are only inherited. A database URI
    (``postgresql://u:pw@db``) keeps its password: the database driver reads it from nowhere else.

    >>> env = {"TRAINGATE_TRACKING_URI": "http://alice:s3cret@mlflow:5000/"}
    >>> move_tracking_credentials(env); env == {"TRAINGATE_TRACKING_URI": "http://mlflow:5000/",
    ...     "MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": "s3cret"}
    True
    """
    env = os.environ if env is None else env
    for var in ("TRAINGATE_TRACKING_URI", "MLFLOW_TRACKING_URI"):
        uri = env.get(var, "")
        parts = urlsplit(uri)
        if parts.scheme not in ("http", "https") or parts.password is None:
            continue
        for name, value in (
            (TRACKING_USERNAME, unquote(parts.username or "")),
            (TRACKING_PASSWORD, unquote(parts.password)),
        ):
            if env.get(name, value) != value:
                raise SpecError(
                    f"{var} = {redact(uri)!r}: its user:password differs from {name}; "
                    f"set the credentials in one place (drop them from the URI or unset {name})"
                )
            env[name] = value
        env[var] = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def refs(obj: Any) -> list[str]:
    """The variable names referenced anywhere in a string or tree, in order of first use."""
    found: list[str] = []

    def walk(o: Any) -> None:
        if isinstance(o, str):
            found.extend(n for n in REF.findall(o) if n not in found)
        elif isinstance(o, Mapping):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return found


# A URL inside a resolved value: where the value would go.
_URL = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*)://[^\s\"'<>]+")
# Schemes that stay on this machine.
_LOCAL_SCHEMES = {"file", "sqlite", "memory", "local"}


def resolve(text: str, env: Mapping[str, str] | None = None, field: str = "value") -> str:
    """``text`` with each ``${env:NAME}`` replaced by the variable's value; ``field`` names it in errors.

    Only names on the allowlist (``TRAINGATE_ENV_ALLOW``, :func:`traingate.settings.env_allowed`)
    resolve, and never into a URL that leaves the machine for a host not allowed
    (:func:`traingate.settings.host_allowed`).
    """
    environ = os.environ if env is None else env
    allow = environ if ENV_ALLOW_VAR in environ else os.environ  # a child's environment built from ours
    # The spec's own literals (moved out by `traingate run`) may go wherever the spec sends them.
    from_environment: list[str] = []

    def value(m: Any) -> str:
        name = m.group(1)
        if not name.startswith(PREFIX):
            from_environment.append(name)
        if not env_allowed(name, allow):
            raise SecretRefError(
                f"{field} = {redact(text)!r}: environment variable {name} is not on the allowlist "
                f"{ENV_ALLOW_VAR}; add {name} to {ENV_ALLOW_VAR} where this runs (the worker's environment, "
                f"for a deployment) or write the value in the spec"
            )
        if name not in environ:
            raise SecretRefError(
                f"{field} = {redact(text)!r}: environment variable {name} is not set; export {name} where this runs "
                f"(on the worker, for a deployment) or write the value in the spec"
            )
        return environ[name]

    out = REF.sub(value, text)
    if from_environment:
        # A URL the spec writes around a reference sends the value to the URL's host. A URL that a variable
        # holds whole (a webhook the operator set) goes where the operator said.
        for url in _URL.finditer(text):
            scheme = url.group("scheme").lower()
            if scheme in _LOCAL_SCHEMES or not REF.search(url.group(0)):
                continue
            if scheme in ("s3", "s3a") and allow.get(S3_ENDPOINT_VAR):
                continue  # the configured S3 endpoint (MinIO, the stack's store) holds every bucket it names
            parts = urlsplit(REF.sub(lambda m: environ.get(m.group(1), ""), url.group(0)))
            host = parts.hostname or parts.netloc.rpartition("@")[2]
            if host and not host_allowed(host, allow):
                raise SecretRefError(
                    f"{field} = {redact(text)!r}: resolves ${{env:{from_environment[0]}}} into a URL to {host}, "
                    f"which is not this machine's or a configured store's; add {host} to {ENV_HOSTS_VAR} if it "
                    "may receive the value, or write the URL without a reference"
                )
    return out


def resolve_tree(obj: Any, env: Mapping[str, str] | None = None, field: str = "") -> Any:
    """A copy of a tree with every reference resolved; an unset variable names its field (``a.b[2]``)."""
    if isinstance(obj, str):
        return resolve(obj, env, field or "value")
    if isinstance(obj, Mapping):
        return {k: resolve_tree(v, env, f"{field}.{k}" if field else str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(resolve_tree(v, env, f"{field}[{i}]") for i, v in enumerate(obj))
    return obj


def check_refs(obj: Any, env: Mapping[str, str] | None = None) -> None:
    """Raise :class:`SecretRefError` for the first reference whose variable is unset (before starting work)."""
    resolve_tree(obj, env)
