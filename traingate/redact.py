"""Keep secrets out of params, tags, artifacts and logs.

One detector serves three callers: :func:`redact` (text), :func:`redact_tree` (configs, with keys
and argument lists), and :mod:`traingate.secrets`, which turns what it finds into
``${env:NAME}`` references instead of ``***``. A ``${env:NAME}`` reference is not a secret and is
left as it is.

>>> redact("s3://AKIA:hunter2@bucket/x")
's3://AKIA:***@bucket/x'
>>> redact("postgresql://optuna:pw@db/x?sslmode=require&password=hunter2")
'postgresql://optuna:***@db/x?sslmode=require&password=***'
>>> redact_mapping({"aws_secret_access_key": "abc", "lr": "0.1"})
{'aws_secret_access_key': '***', 'lr': '0.1'}
>>> redact("python train.py --api-token tok-123 --lr 0.1")
'python train.py --api-token *** --lr 0.1'
>>> redact("https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIAX%2F2024&X-Amz-Signature=9f1c&x=1")
'https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&x=1'
>>> redact_tree({"command": ["python", "t.py", "--api-token", "tok-123"], "key": "${env:TOKEN}"})
{'command': ['python', 't.py', '--api-token', '***'], 'key': '${env:TOKEN}'}
"""

from __future__ import annotations

import functools
import logging
import os
import re
import traceback
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote

MASK = "***"

# A reference to an environment variable (see traingate.secrets): it names a secret, it is not one.
REF = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")
_REF = r"\$\{env:[A-Za-z_][A-Za-z0-9_]*\}"

# Names that hold a secret when a key or flag ENDS with them: `aws_secret_access_key`,
# `--api-token`, `X-Amz-Credential`. Ending, not containing: `tokenizer` and `max_tokens` are not secrets.
_WORD = (
    r"(?:secret|password|passwd|passphrase|token|api[_-]?key|apikey|access[_-]?key(?:[_-]?id)?"
    r"|secret[_-]?key|private[_-]?key|credentials?|signature)"
)
_KEY_NAME = re.compile(rf"[\w.-]*{_WORD}", re.I)
# A flag names its secret more tersely than a config key does (`--wandb-key`, `--db-pass`, `--pw`): a flag
# ending in one of these takes a secret too. Not keys: `sort_key: loss` or `passes: 3` are settings.
_FLAG_WORD = rf"(?:{_WORD}|key|pass|pwd|pw|auth)"
_FLAG = re.compile(rf"--?[\w-]*{_FLAG_WORD}", re.I)

# A value in free text: a quoted string (to its closing quote), a reference, or a bare token.
_BARE = r"""[^\s&"',;}\]]+"""
_VALUE = rf"""(?P<q>["'])?(?P<v>(?(q)(?:(?!(?P=q))[^\n])+|(?:{_REF}|{_BARE})))"""

# Patterns 2-3 (keys and flags) scan every position of a line: most lines hold none of the words, so
# one cheap search decides whether they run at all.
_HINT = re.compile(r"secret|pass|pw|token|key|credential|signature|auth", re.I)
_PATTERNS = [
    # scheme://user:password@host (a password may hold `/`: users paste AWS keys unescaped)
    re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s\"']+:(?P<v>[^@\s\"']+?)@"),
    # scheme://TOKEN@host: a long bare token as the whole userinfo (git https tokens)
    re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://(?P<v>[A-Za-z0-9_~.-]{20,})@"),
    # key=value, key: value, "key": "value", query parameters
    re.compile(rf"(?<![\w.-]){_KEY_NAME.pattern}[\"']?[ \t]*[=:][ \t]*{_VALUE}", re.I),
    # --flag VALUE, --flag=VALUE, and the same flag/value pair inside a printed list
    re.compile(rf"""(?<![\w-]){_FLAG.pattern}(?:[ \t]*=[ \t]*|["']?[ \t]*,[ \t]*|[ \t]+){_VALUE}""", re.I),
    # Azure SAS and other presigned URLs sign with a short `sig` parameter
    re.compile(r"[?&;]sig=(?P<v>[^&\s#\"']+)", re.I),
    # Authorization headers, and bearer tokens wherever they are printed
    re.compile(r"\bbearer[ \t]+(?P<v>[A-Za-z0-9._~+/-]{8,}=*)", re.I),
    re.compile(rf"authorization[\"']?[ \t]*[=:][ \t]*(?:\w+[ \t]+)?{_VALUE}", re.I),
    # AWS access key ids, wherever they appear
    re.compile(r"\b(?P<v>(?:AKIA|ASIA)[A-Z0-9]{16})\b"),
    # Webhook URLs carry their token in the path: Slack (hooks.slack.com/services/...), Discord
    # (discord.com/api/webhooks/ID/TOKEN), and any other .../hooks/... or .../webhooks/... endpoint.
    re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s\"']+/(?:[^\s\"'?#]*/)?(?:hooks|webhooks?)/(?P<v>[^\s\"'?#]+)"),
    re.compile(r"://hooks\.slack\.com/(?P<v>[^\s\"'?#]+)", re.I),
]

_WORD_PATTERNS = (_PATTERNS[2], _PATTERNS[3])

# Environment variables whose values are secrets wherever they are printed.
_SECRET_ENV_EXPLICIT = re.compile(r"AWS_.*|MLFLOW_TRACKING_(?:PASSWORD|TOKEN)|PREFECT_API_KEY|TRAINGATE_SECRET_.*")
# AWS_* settings that are not secrets; masking them would blank out regions and endpoints in every log.
_AWS_NOT_SECRET = re.compile(
    r"AWS_.*(?:REGION|PROFILE|_FILE|ENDPOINT_URL.*|CA_BUNDLE|OUTPUT|ATTEMPTS|MODE|DISABLED|ENDPOINTS"
    r"|PAGER|TIMEOUT.*)"
)
_SECRET_ENV_NAMED = re.compile(r".*(?:TOKEN|SECRET|PASS|PWD|KEY|CREDENTIAL|AUTH|WEBHOOK).*", re.I)
# Named like a secret but holding a directory (the shell's working directory) or plain settings.
_NOT_SECRET_ENV = re.compile(
    r"(?:OLD)?PWD|.*_(?:PATH|DIR|FILE|HOME|SOCK)|.*(?:KEYBOARD|KEYMAP|PASSTHROUGH|AUTHORITY|ASKPASS).*", re.I
)
# TRAINGATE_SECRET_BLOCKS: VAR=block,... (traingate.settings.secret_blocks). Each VAR holds the value of a
# Prefect Secret block, whatever its name says: certainly a secret.
_SECRET_BLOCKS_VAR = "TRAINGATE_SECRET_BLOCKS"
# Exact values known to be secret in this process (register_secret): masked wherever they appear.
_REGISTERED: set[str] = set()


def register_secret(value: str) -> None:
    """Mask ``value`` wherever this process writes it (a Secret block's value, a generated password)."""
    if len(value) >= _SHORT:
        _REGISTERED.add(value)


# Long values are masked wherever they occur; short values of variables that are certainly
# secrets only as whole words, so a 4-letter password does not blank out parts of other words.
_LONG = 8
_SHORT = 4


@functools.lru_cache(maxsize=4096)
def _env_kind(name: str) -> tuple[bool, bool]:
    """(certainly a secret, named like one) for an environment variable's name."""
    upper = name.upper()
    explicit = bool(_SECRET_ENV_EXPLICIT.fullmatch(upper)) and not _AWS_NOT_SECRET.fullmatch(upper)
    return explicit, bool(_SECRET_ENV_NAMED.fullmatch(name)) and not _NOT_SECRET_ENV.fullmatch(name)


def _env_secrets() -> tuple[list[str], list[str]]:
    """(values masked anywhere, short values masked as whole words), from the current environment: computed again
    only when the environment or the registered secrets changed (every log record and every param asks; a
    comparison of the environment's raw items costs a tenth of reading them)."""
    global _ENV_SEEN
    key = (tuple(os.environ._data.items()), id(_REGISTERED), len(_REGISTERED))  # type: ignore[attr-defined]
    seen = _ENV_SEEN
    if seen is not None and seen[0] == key:
        return seen[1]
    found = _read_env_secrets()
    _ENV_SEEN = (key, found)
    return found


_ENV_SEEN: tuple[tuple[tuple[Any, ...], int, int], tuple[list[str], list[str]]] | None = None


def _read_env_secrets() -> tuple[list[str], list[str]]:
    long_: set[str] = set()
    short: set[str] = set()
    blocks = {e.partition("=")[0].strip() for e in os.environ.get(_SECRET_BLOCKS_VAR, "").split(",")}
    for value in _REGISTERED:
        (long_ if len(value) >= _LONG else short).add(value)
    for name, value in os.environ.items():
        if len(value) < _SHORT:
            continue
        explicit, named = _env_kind(name)
        explicit = explicit or name in blocks
        if len(value) >= _LONG and (explicit or named):
            long_.add(value)
            if (q := quote(value, safe="")) != value:  # the same secret inside a URL
                long_.add(q)
        elif explicit:
            short.add(value)
    return sorted(long_, key=len, reverse=True), sorted(short, key=len, reverse=True)


def secret_spans(text: str) -> list[tuple[int, int]]:
    """The (start, end) spans of ``text`` that hold secrets, merged and sorted."""
    spans: list[tuple[int, int]] = []
    hinted = _HINT.search(text) is not None
    for rx in _PATTERNS:
        if rx in _WORD_PATTERNS and not hinted:
            continue
        for m in rx.finditer(text):
            s, e = m.span("v")
            if e > s and not REF.fullmatch(text[s:e]):
                spans.append((s, e))
    long_, short = _env_secrets()
    for value in long_:
        start = text.find(value)
        while start >= 0:
            spans.append((start, start + len(value)))
            start = text.find(value, start + len(value))
    for value in short:
        for m in re.finditer(rf"(?<![A-Za-z0-9]){re.escape(value)}(?![A-Za-z0-9])", text):
            spans.append(m.span())
    spans.sort()
    merged: list[tuple[int, int]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def replace_secrets(text: str, replace: Callable[[str], str]) -> str:
    """``text`` with every secret span passed through ``replace`` (``redact`` replaces with ``***``)."""
    spans = secret_spans(text)
    if not spans:
        return text
    out, pos = [], 0
    for s, e in spans:
        out += [text[pos:s], replace(text[s:e])]
        pos = e
    out.append(text[pos:])
    return "".join(out)


def redact(text: str) -> str:
    """``text`` with every secret it holds replaced by ``***``."""
    return replace_secrets(text, lambda _: MASK)


def is_secret_key(key: Any) -> bool:
    return isinstance(key, str) and bool(_KEY_NAME.fullmatch(key))


def is_secret_flag(arg: Any) -> bool:
    """``--api-token``, ``--password``: the NEXT argument is a secret."""
    return isinstance(arg, str) and bool(_FLAG.fullmatch(arg))


def map_secrets(obj: Any, replace: Callable[[str], str], _whole: bool = False) -> Any:
    """A copy of a config tree with each secret passed through ``replace``.

    A secret is: any value under a secret-named key (``password: x``, also inside lists and nested
    mappings below it), the argument after a secret flag in a list (``[--api-token, x]``), and
    every span :func:`secret_spans` finds in any other string. Tuples stay tuples.
    """
    if isinstance(obj, Mapping):
        return {k: map_secrets(v, replace, _whole or is_secret_key(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = []
        for i, item in enumerate(obj):
            after_flag = i > 0 and is_secret_flag(obj[i - 1]) and isinstance(item, str)
            out.append(map_secrets(item, replace, _whole or after_flag))
        return type(obj)(out)
    if _whole and isinstance(obj, (str, int, float)) and not isinstance(obj, bool):
        text = str(obj)
        return text if not text or REF.fullmatch(text) else replace(text)
    if isinstance(obj, str):
        return replace_secrets(obj, replace)
    return obj


def redact_tree(obj: Any) -> Any:
    """A copy of a config tree (mappings, lists, tuples, scalars) with every secret masked."""
    return map_secrets(obj, lambda _: MASK)


def redact_mapping(d: Mapping[str, Any]) -> dict[str, Any]:
    return redact_tree(d)


def redact_record(record: logging.LogRecord) -> None:
    """Redact a log record in place: its message, and its traceback if it has one."""
    try:
        msg = record.getMessage()
    except (TypeError, ValueError, KeyError):
        # A malformed logging call: logging reports it with the raw arguments, so mask them first.
        record.msg = redact(str(record.msg))
        record.args = tuple(redact(repr(a)) for a in record.args) if isinstance(record.args, tuple) else None
        return
    clean = redact(msg)
    if clean != msg:
        record.msg, record.args = clean, None
    if record.exc_info and not record.exc_text:
        text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        if (clean_exc := redact(text)) != text:
            record.exc_text = clean_exc
    elif record.exc_text:
        record.exc_text = redact(record.exc_text)
    if record.stack_info:
        record.stack_info = redact(record.stack_info)


class RedactingFilter(logging.Filter):
    """A logging filter that redacts every record's message (install it on the handlers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        redact_record(record)
        return True


def install_log_redaction() -> None:
    """Redact every log record this process creates, whichever logger or handler it goes to.

    Handler filters miss handlers created later (a logging reconfiguration); the record factory
    runs for every record, after the level check, so disabled debug calls cost nothing. Idempotent.
    """
    factory = logging.getLogRecordFactory()
    if getattr(factory, "_traingate_redacting", False):
        return

    def make(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        redact_record(record)
        return record

    make._traingate_redacting = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(make)
