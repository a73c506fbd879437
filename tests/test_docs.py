"""The README is a front door and the manual is an MkDocs site that builds, links and names what exists.

The site is built with mkdocs --strict (a broken link, anchor or nav entry, or a page left out of the nav
fails it); README and docs say what IS, so history phrases are refused there and in the code's comments.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from tgtest import PYTHON, ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250

# Phrases that tell a story of how things were instead of what they are. Each is specific enough that
# present-tense prose does not trip it ("the location it was created with" is fine; "it was 1.48x" is not).
HISTORY = [
    r"\bissues? #?\d+",  # "issue 13", "issues 2 and 9"
    r"\b(before|after|since|until) (this|that|the last) (change|work|commit|fix|refactor)\b",
    r"\b(in|with|by|since|after|before) this (change|commit)\b",
    r"\bit was \d",  # a number's history: "(it was 1.48x, then ...)"
    r"\b(it|this|that) used to\b",
    r"\bused to be\b",
    r"\bformerly\b",
    r"\bfails today\b",
    r"\bnot (covered|wired|done|shipped) yet\b",
    r"\bnow\b[^.\n]{0,60}\binstead of\b",  # "now X instead of Y"
    r"\bno longer\b[^.\n]{0,40}\b(import|use|call|need)s?\b",  # "X no longer imports Y"
]
# Prose (README and docs) is held to more: "it was" tells history there.
PROSE_ONLY = [r"\bit was\b", r"\bbefore this\b", r"\bI have\b"]
CODE_DIRS = ("traingate", "flows", "tasks")


def _docs() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _scan(text: str, patterns: list[str]) -> list[tuple[int, str, str]]:
    """(line number, phrase, line) for each line of text where a pattern matches."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for pat in patterns:
            m = re.search(pat, line, re.IGNORECASE)
            if m:
                out.append((n, m.group(0), line.strip()))
    return out


def _hits(path: Path, patterns: list[str]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{n}: {phrase!r} in: {line[:120]}"
        for n, phrase, line in _scan(path.read_text(encoding="utf-8"), patterns)
    ]


def test_the_manual_builds_with_mkdocs_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    p = subprocess.run(
        [PYTHON, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert p.returncode == 0, f"mkdocs build --strict failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    for page in _docs():
        rel = page.relative_to(DOCS).with_suffix("")
        built = tmp_path / "site" / ("index.html" if rel.name == "index" else f"{rel}/index.html")
        assert built.exists(), f"{page} was not built into the site"


def test_the_readme_is_a_front_door_of_at_most_250_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; the limit is {README_MAX_LINES}: move the detail into a docs/ page"
    )
    text = "\n".join(lines)
    for cmd in ("make demo", "make test", "make test-fast"):
        assert cmd in text, f"README.md does not name `{cmd}`"


def test_every_readme_link_into_docs_names_a_page_of_the_site():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    links = re.findall(r"\]\((docs/[^)#\s]+)", README.read_text(encoding="utf-8"))
    assert links, "README.md links into no docs page"
    for link in links:
        assert (ROOT / link).is_file(), f"README.md links {link}, which does not exist"
        assert Path(link).relative_to("docs").as_posix() in nav, f"README.md links {link}, which is not in the nav"


def test_readme_docs_and_code_comments_say_what_is_not_history():
    hits = []
    for path in [README, *_docs()]:
        hits += _hits(path, HISTORY + PROSE_ONLY)
    for d in CODE_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            hits += _hits(path, HISTORY)
    assert not hits, "history phrases; say what is instead:\n" + "\n".join(hits)


@pytest.mark.parametrize(
    "patterns,text",
    [
        (HISTORY, "Ladder / bare = 1.16x (it was 1.48x, then 1.41x)"),
        (HISTORY, "### Ladder overhead (issues 2 and 9)"),
        (HISTORY, "the training processes no longer import MLflow"),
        (HISTORY, "34% on an idle machine before this change"),
        (HISTORY, "the ladder now resumes the run instead of starting a third"),
        (PROSE_ONLY, "back in 0.5 s (it was 5.2 s before this work)"),
    ],
)
def test_the_history_check_catches_a_sentence_that_tells_history(patterns, text):
    assert _scan(text, patterns), f"{text!r} passed the history check"


@pytest.mark.parametrize(
    "text",
    [
        "An existing experiment keeps the location it was created with",
        "Ranks whose heartbeat pid no longer runs",
        "the step it was first logged at",
    ],
)
def test_the_code_history_check_passes_present_tense_prose(text):
    assert not _scan(text, HISTORY)


# ------------------------------------------------------------------ what the docs name exists
# Paths a page names that are not in the repository on purpose, each with its reason.
NOT_IN_REPOSITORY = {
    "infra/.env": "the production stack's secrets file: written by the operator, never committed",
}
_PATH = re.compile(r"`((?:traingate|flows|tasks|tests|examples|infra|deployments|bench|docs)/[\w./-]*)(?:::[^`]*)?`")


def test_every_repository_path_the_readme_and_docs_name_exists():
    missing = []
    for page in [README, *_docs()]:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for path in _PATH.findall(line):
                if path not in NOT_IN_REPOSITORY and not (ROOT / path.rstrip("/")).exists():
                    missing.append(f"{page.relative_to(ROOT)}:{n}: {path}")
    assert not missing, "paths that do not exist (moved? update the page):\n" + "\n".join(missing)


def test_every_test_the_threat_model_cites_exists():
    """Each claim of docs/threat-model.md names the test that shows it: the file and the test function."""
    import ast

    text = (ROOT / "docs" / "threat-model.md").read_text(encoding="utf-8")
    cited = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text)
    assert len(cited) >= 15, cited
    missing = []
    for path, name in cited:
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        if name not in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}:
            missing.append(f"{path}::{name}")
    assert not missing, "tests the threat model cites that do not exist:\n" + "\n".join(missing)


# Prints each argv's --help of the console script's entry point, in one process (imports paid once).
_HELP_SCRIPT = """
import contextlib, importlib, io, json, sys
module, func = sys.argv[1].split(":")
main = getattr(importlib.import_module(module), func)
out = {}
for argv in json.loads(sys.argv[2]):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        main([*argv, "--help"])
    out[" ".join(argv)] = buf.getvalue()
print(json.dumps(out))
"""


def _helptexts(argvs: list[list[str]]) -> dict[str, str]:
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]["traingate"]
    p = subprocess.run(
        [PYTHON, "-c", _HELP_SCRIPT, entry, json.dumps(argvs)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert p.returncode == 0, f"traingate --help failed: {p.stderr[-3000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def _subcommands() -> dict[str, str]:
    """Each `traingate` subcommand (and each `traingate pools` subcommand) -> its --help text."""
    names = re.search(r"\{([a-z,-]+)\}", _helptexts([[]])[""]).group(1).split(",")
    out = _helptexts([[name] for name in names])
    pools = re.search(r"\{([a-z,-]+)\}", out["pools"]).group(1).split(",")
    out |= _helptexts([["pools", sub] for sub in pools])
    return out


def test_every_traingate_command_and_flag_the_readme_and_docs_show_exists():
    helps = _subcommands()
    wrong = []
    for page in [README, *_docs()]:
        fence = None  # the language of the code block the line is in
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip().startswith("```"):
                fence = None if fence is not None else line.strip().removeprefix("```")
                continue
            # Commands are the lines of shell blocks, and `$ ` lines of output blocks (drawings are not).
            cmd = line.strip()
            if fence in ("bash", "sh", "console") and cmd.startswith("traingate "):
                pass
            elif fence is not None and cmd.startswith("$ traingate "):
                cmd = cmd.removeprefix("$ ")
            else:
                continue
            words = cmd.split("#")[0].split()
            if len(words) < 2 or words[1].startswith("-"):
                continue
            name = f"pools {words[2]}" if words[1] == "pools" and len(words) > 2 else words[1]
            if name not in helps:
                wrong.append(f"{page.relative_to(ROOT)}:{n}: no command `traingate {name}`")
                continue
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", cmd.split("#")[0]):
                if flag not in helps[name]:
                    wrong.append(f"{page.relative_to(ROOT)}:{n}: `traingate {name}` has no {flag}")
    assert not wrong, "\n".join(wrong)
