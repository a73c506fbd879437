"""Search space -> Optuna suggestions, and a sampled point -> a runnable RunSpec.

>>> from traingate.sweepspec import ParamSpec
>>> space = {"optim.schedule": ParamSpec(type="categorical", choices=["constant", "cosine"]),
...          "optim.warmup_steps": ParamSpec(type="int", low=0, high=10, when={"optim.schedule": "cosine"})}
>>> active({"optim.schedule": "cosine"}, space["optim.warmup_steps"].when)
True
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, Literal

import numpy as np
import optuna
import yaml
from pydantic import BaseModel

from traingate.recipes import SCRIPT
from traingate.recipes.facts import recipe_facts
from traingate.spec import RecipeSpec, RunSpec, SpecError, apply_overrides, parse_spec
from traingate.sweepspec import ParamSpec


def active(chosen: dict[str, Any], when: dict[str, Any] | None) -> bool:
    """Whether a conditional parameter applies, given the values sampled so far."""
    for name, want in (when or {}).items():
        allowed = want if isinstance(want, list) else [want]
        if name not in chosen or chosen[name] not in allowed:
            return False
    return True


def _choices(p: ParamSpec) -> list[Any]:
    assert p.choices is not None, "a categorical parameter has choices (ParamSpec validates it)"
    return p.choices


def _bounds(p: ParamSpec) -> tuple[float, float]:
    assert p.low is not None and p.high is not None, "a range has low and high (ParamSpec validates it)"
    return p.low, p.high


def distribution(p: ParamSpec) -> optuna.distributions.BaseDistribution:
    if p.type == "categorical":
        return optuna.distributions.CategoricalDistribution(_choices(p))
    low, high = _bounds(p)
    if p.type == "int":
        return optuna.distributions.IntDistribution(int(low), int(high), log=p.log, step=int(p.step or 1))
    return optuna.distributions.FloatDistribution(low, high, log=p.log, step=p.step)


def suggest(trial: optuna.Trial, space: dict[str, ParamSpec]) -> dict[str, Any]:
    """Sample every active parameter, in declaration order (so `when` can see earlier values)."""
    chosen: dict[str, Any] = {}
    for name, p in space.items():
        if not active(chosen, p.when):
            continue
        if p.type == "categorical":
            chosen[name] = trial.suggest_categorical(name, _choices(p))
            continue
        low, high = _bounds(p)
        if p.type == "int":
            chosen[name] = trial.suggest_int(name, int(low), int(high), step=int(p.step or 1), log=p.log)
        else:
            chosen[name] = trial.suggest_float(name, low, high, step=p.step, log=p.log)
    return chosen


def grid(space: dict[str, ParamSpec]) -> dict[str, list[Any]]:
    """Every value of every parameter (the grid sampler's search space)."""
    out: dict[str, list[Any]] = {}
    for name, p in space.items():
        if p.type == "categorical":
            out[name] = list(_choices(p))
            continue
        low, high = _bounds(p)
        if p.type == "int":
            out[name] = list(range(int(low), int(high) + 1, int(p.step or 1)))
        else:
            assert p.step is not None, "validated by SweepSpec"
            n = int(round((high - low) / p.step))
            out[name] = [float(v) for v in np.round(low + p.step * np.arange(n + 1), 12)]
    return out


def grid_size(space: dict[str, ParamSpec]) -> int:
    return int(np.prod([len(v) for v in grid(space).values()]))


def _plain(v: Any) -> Any:
    return v.item() if isinstance(v, np.generic) else v


def trial_spec(base: RunSpec, params: dict[str, Any], seed: int | None = None) -> RunSpec:
    """The RunSpec one trial runs: the base spec with the sampled values set, no sweep section."""
    tree = base.to_dict()
    tree["sweep"] = None
    for key, value in params.items():
        node = tree
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = _plain(value)
    if seed is not None:
        apply_overrides(tree, [f"optim.seed={seed}"])
    try:
        return parse_spec(tree)
    except SpecError as e:
        raise SpecError(f"sweep point {params}: {e}") from None


def _optional(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return annotation


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def field_type(base: RunSpec, name: str) -> Any:
    """The type of the spec field a dotted search-space key sets (SpecError for a path that is none)."""
    parts = name.split(".")
    if parts[0] == "sweep":
        raise SpecError(f"sweep.space.{name}: a trial's spec has no sweep section; search spec fields outside it")
    model: Any = type(base)
    annotation: Any = None
    done: list[str] = []
    i = 0
    while i < len(parts):
        if model is None:
            raise SpecError(
                f"sweep.space.{name}: {'.'.join(done)} is a value, not a section (unknown key "
                f"{parts[i]!r}); use the dotted path of a field, e.g. optim.lr"
            )
        part = parts[i]
        done.append(part)
        i += 1
        if model is RecipeSpec and part == "params":
            if base.recipe.name == SCRIPT:
                raise SpecError(
                    f"sweep.space.{name}: a script recipe is not given recipe.params; search its "
                    "arguments through recipe.script.stage_args instead"
                )
            model, annotation = recipe_facts(base).Params, dict
            continue
        field = model.model_fields.get(part)
        if field is None:
            raise SpecError(
                f"sweep.space.{name}: {'.'.join(done)} is not a spec field (unknown key); use the dotted "
                f"path of a field, e.g. optim.lr or recipe.params.<name>"
            )
        annotation = _optional(field.annotation)
        if typing.get_origin(annotation) is dict and i < len(parts):
            done.append(parts[i])  # a named entry: pools.<pool>, gates.<stage>
            i += 1
            annotation = _optional(typing.get_args(annotation)[1])
        model = annotation if _is_model(annotation) else None
    return annotation


def _fits(p: ParamSpec, annotation: Any) -> bool:
    """Whether every value ``p`` can sample has the field's type (pydantic would coerce 3.7 or '0.1')."""
    if p.type == "categorical":
        kinds = {type(c) for c in p.choices or []}
        if annotation is bool:
            return kinds <= {bool}
        if annotation is int:
            return kinds <= {int}
        if annotation is float:
            return kinds <= {int, float}
        if annotation is str or typing.get_origin(annotation) is Literal:
            return kinds <= {str}
        return not _is_model(annotation) and typing.get_origin(annotation) not in (dict, list)
    if p.type == "int":
        return annotation in (int, float)
    return annotation is float


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    return getattr(annotation, "__name__", str(annotation))


def check_space(base: RunSpec) -> None:
    """Check every parameter against the field it sets (path, type, bounds, choices) before any trial runs."""
    assert base.sweep is not None
    for name, p in base.sweep.space.items():
        annotation = field_type(base, name)
        if not _fits(p, annotation):
            what = (
                f"choices of type {sorted({type(c).__name__ for c in p.choices or []})}"
                if p.type == "categorical"
                else f"a {p.type} range"
            )
            want = {
                int: "type: int, or categorical of whole numbers",
                float: "type: float or int",
                bool: "categorical of true/false",
            }.get(annotation, "categorical of valid values")
            raise SpecError(
                f"sweep.space.{name}: {what} cannot set {name}, which takes {_type_name(annotation)}; use {want}"
            )
        values = _choices(p) if p.type == "categorical" else list(_bounds(p))
        for v in values:
            v = int(v) if p.type == "int" else v
            try:
                trial_spec(base, {name: v})
            except SpecError as e:
                raise SpecError(
                    f"sweep.space.{name}: the value {v!r} does not make a valid spec ({e}); "
                    f"check the dotted path and the range"
                ) from None


def write_spec(spec: RunSpec, path: str | Path, header: str = "") -> Path:
    """Write a ready-to-run spec (`traingate run PATH`)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tree = spec.to_dict()
    tree.pop("sweep", None)
    text = "".join(f"# {line}\n" for line in header.splitlines()) + yaml.safe_dump(tree, sort_keys=False)
    p.write_text(text)
    return p
