"""Every field of the spec schema is read by some code outside the schema: a value the schema accepts and
nothing reads does nothing, which is a lie to whoever sets it (alerts.checkpoint_stale was one).

The pydantic models under RunSpec are walked recursively; a field counts as read where its name is an
attribute access (``x.factor``) or a string key (``tree["factor"]``, ``getattr(x, "factor")``) in
traingate/, flows/ or tasks/, outside the bodies of the schema classes themselves (their validators read
their own fields to check them, not to act on them).
"""
from __future__ import annotations

import ast
import types
import typing
from pathlib import Path

from pydantic import BaseModel

from tgtest import ROOT
from traingate.spec import RunSpec

# (model, field) that no code reads by name, each with the reason it still does what it says. Empty: every
# field is read by name somewhere (stages.smoke/canary/full through getattr(spec.stages, "smoke"), ...).
READ_GENERICALLY: dict[tuple[str, str], str] = {}


def _models(model: type[BaseModel], seen: dict[str, type[BaseModel]]) -> dict[str, type[BaseModel]]:
    if model.__name__ in seen:
        return seen
    seen[model.__name__] = model
    for f in model.model_fields.values():
        for t in _types(f.annotation):
            if isinstance(t, type) and issubclass(t, BaseModel):
                _models(t, seen)
    return seen


def _types(annotation: object) -> list[object]:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list, dict, tuple) or args:
        return [t for a in args for t in _types(a)]
    return [annotation]


def _reads(schema_classes: set[str]) -> set[str]:
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.ClassDef) and node.name in schema_classes:
            return
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)
        for child in ast.iter_child_nodes(node):
            visit(child)

    for top in ("traingate", "flows", "tasks"):
        for path in (ROOT / top).rglob("*.py"):
            visit(ast.parse(path.read_text(), str(path)))
    return names


def test_every_spec_schema_field_is_read_by_code_outside_the_schema():
    models = _models(RunSpec, {})
    assert {"RunSpec", "ScriptRecipe", "AlertsSpec", "CheckpointStaleSpec", "SweepSpec", "PoolSpec"} <= set(models)
    read = _reads(set(models))
    unread = sorted(f"{m}.{name}" for m, model in models.items() for name in model.model_fields
                    if name not in read and (m, name) not in READ_GENERICALLY)
    assert not unread, f"spec fields no code reads (wire them, remove them, or allowlist with the reason): {unread}"
    needless = sorted(f"{m}.{name}" for m, name in READ_GENERICALLY if name in read)
    assert not needless, f"allowlisted, yet read by name: {needless}; drop them from READ_GENERICALLY"


def test_the_scan_finds_a_field_only_the_schema_reads(tmp_path):
    """The check can fail: a field read only inside its own schema class is not counted."""

    class Probe(BaseModel):
        never_read_anywhere_xyz: int = 0

        def own(self) -> int:
            return self.never_read_anywhere_xyz

    assert "never_read_anywhere_xyz" not in _reads({"Probe"})
    assert "model_fields" in _reads(set())  # and it does see ordinary attribute reads
