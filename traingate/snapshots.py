"""The newest data snapshot: a ``{latest}`` segment in ``data.uri`` resolved to a concrete version.

Data teams publish dated snapshots under one prefix (``s3://corpus/2026-11-20/input.txt``, ...) and a
scheduled retrain should train on the newest. ``data.uri`` may then name the version segment
``{latest}``: it resolves to the content of a ``LATEST`` pointer file under the prefix when there is
one (a publisher writes it last, so a half-uploaded snapshot is never picked), else to the greatest
child name that holds the rest of the path, compared with numbers as numbers (``2026-11-20`` sorts by
date, ``v10`` after ``v9``).

The ladder resolves once, before its identity is taken: the concrete URI is in the run's identity and
its resolved spec, so every stage process (and a resume) reads the same version even if a newer one
lands mid-run.

>>> newest(["2026-11-09", "2026-11-20", "2026-11-3", "LATEST"])
'2026-11-20'
"""

from __future__ import annotations

import posixpath
import re

import fsspec

from traingate.redact import redact
from traingate.secrets import resolve
from traingate.spec import RunSpec, SpecError, parse_spec
from traingate.storage import storage_options

LATEST = "{latest}"
POINTER = "LATEST"
_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=-]*")  # a version name: one path segment, not hidden


def has_latest(uri: str | None) -> bool:
    return uri is not None and LATEST in uri


def _key(name: str) -> tuple:
    """Natural order: digit runs compare as numbers, so dates and version numbers sort as they read."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.findall(r"\d+|\D+", name))


def _is_version(name: str) -> bool:
    return name != POINTER and _SEGMENT.fullmatch(name) is not None  # not the pointer, nor hidden (.tmp, _SUCCESS)


def newest(names: list[str]) -> str | None:
    """The greatest version name among ``names``."""
    versions = [n for n in names if _is_version(n)]
    return max(versions, key=_key) if versions else None


def _split(uri: str, field: str) -> tuple[str, str]:
    """(prefix, rest) around the one ``{latest}`` segment; refused when it is not exactly one whole segment."""
    shown = redact(uri)
    if uri.count(LATEST) != 1:
        raise SpecError(
            f"{field} = {shown!r}: {LATEST} appears {uri.count(LATEST)} times; use it once, as the "
            "version segment (e.g. s3://bucket/corpus/{latest}/input.txt)"
        )
    prefix, rest = uri.split(LATEST)
    if not prefix.endswith("/") or (rest and not rest.startswith("/")):
        raise SpecError(
            f"{field} = {shown!r}: {LATEST} must be a whole path segment (e.g. s3://bucket/corpus/{{latest}}/input.txt)"
        )
    return prefix, rest


def resolve_latest(uri: str, field: str = "data.uri") -> str:
    """``uri`` with its ``{latest}`` segment replaced by the newest version under the prefix before it.

    ``${env:...}`` references are resolved to list the store and kept in the returned URI (it is
    written into the run's spec and identity). Raises :class:`SpecError` (one line) when no version exists.
    """

    prefix, rest = _split(uri, field)
    real_prefix = resolve(prefix, field=field)
    real_rest = resolve(rest, field=field)
    fs, path = fsspec.core.url_to_fs(real_prefix, **storage_options(real_prefix))
    path = path.rstrip("/")
    fs.invalidate_cache(path)  # a listing cached by an earlier resolve would hide the snapshot published since
    pointer = posixpath.join(path, POINTER)
    where = f"{redact(prefix)}"
    if fs.isfile(pointer):
        version = fs.cat_file(pointer).decode("utf-8", errors="replace").strip()
        if not _SEGMENT.fullmatch(version):
            raise SpecError(
                f"{field} = {redact(uri)!r}: the pointer file {where}{POINTER} holds {version[:80]!r}, "
                "not a version name; write the name of one snapshot directory into it"
            )
        if not fs.exists(path + "/" + version + real_rest):
            raise SpecError(
                f"{field} = {redact(uri)!r}: the pointer file {where}{POINTER} names {version!r}, but "
                f"{redact(prefix + version + rest)} does not exist; publish it or fix the pointer"
            )
        return prefix + version + rest
    try:
        children = [posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False)]
    except FileNotFoundError:
        children = []
    # Newest first; a version lacking the rest of the path (still being copied) is passed over.
    for version in sorted({n for n in children if _is_version(n)}, key=_key, reverse=True):
        if not rest or fs.exists(path + "/" + version + real_rest):
            return prefix + version + rest
    raise SpecError(
        f"{field} = {redact(uri)!r}: no snapshot under {where} (no {POINTER} pointer file and no "
        f"version directory{' holding ' + rest.lstrip('/') if rest else ''}); publish one there or "
        "name a version instead of {latest}"
    )


def resolve_spec(spec: RunSpec) -> RunSpec:
    """``spec`` with ``data.uri``'s ``{latest}`` resolved (the same spec when it has none)."""
    if not has_latest(spec.data.uri):
        return spec
    assert spec.data.uri is not None
    tree = spec.to_dict()
    tree["data"]["uri"] = resolve_latest(spec.data.uri)
    return parse_spec(tree)


__all__ = ["LATEST", "POINTER", "has_latest", "newest", "resolve_latest", "resolve_spec"]
