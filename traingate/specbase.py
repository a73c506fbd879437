"""What every spec section is built from: the pydantic base model, the name check and the shared limits.

The bottom of the import graph: spec.py and every package's spec section (``sweep/config.py``,
``monitor/rules.py``, ``recipes/base.py``) import this module; it imports nothing of traingate.
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


class SpecModel(BaseModel):
    """Base of every spec section (RunSpec's and every package's section).

    Unknown keys, inf/nan and booleans given for numbers are errors, not silent defaults.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: ValidationInfo) -> Any:
        why = bool_for_number(cls.model_fields[info.field_name].annotation, value) if info.field_name else None
        if why:
            raise ValueError(why)
        return value
