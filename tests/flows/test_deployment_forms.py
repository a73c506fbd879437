"""The run form of every deployment in deployments/prefect.yaml, as the Prefect UI builds and checks it.

The UI draws a deployment's form from its ``parameter_openapi_schema`` (what ``prefect deploy`` computes
with ``parameter_schema``), fills it with the deployment's parameters, and the server checks what the
user submits against that schema before it creates the flow run; the worker's flow then validates the
values into its annotated types. Here: the same three steps, for every deployment (ladder, stage,
resume, retrain, CI, sweep), with the form edited the way a user edits it.
"""
from __future__ import annotations

import copy
import inspect

import pytest
import yaml
from prefect.flows import load_flow_from_entrypoint
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools.validation import ValidationError, is_valid_schema, validate

from tgtest import ROOT
from traingate.spec import RunSpec

DEPLOYMENTS = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())["deployments"]


def _form(d: dict):
    path, name = d["entrypoint"].split(":")
    flow = load_flow_from_entrypoint(str(ROOT / path) + ":" + name)
    return flow, parameter_schema(flow).model_dump_for_openapi()


@pytest.mark.parametrize("d", DEPLOYMENTS, ids=[d["name"] for d in DEPLOYMENTS])
def test_every_deployments_form_renders_and_accepts_its_own_parameters(d):
    flow, schema = _form(d)
    is_valid_schema(schema)
    assert validate(d.get("parameters", {}), schema, raise_on_error=True) == []
    flow.validate_parameters(d.get("parameters", {}))
    spec_field = schema["properties"].get("spec")
    if spec_field is not None:  # a RunSpec is a form of sections, not a text box for a path
        refs = [a.get("$ref") for a in spec_field.get("anyOf", [spec_field])]
        assert "#/definitions/RunSpec" in refs, spec_field
        assert set(schema["definitions"]["RunSpec"]["properties"]) == set(RunSpec.model_fields)


@pytest.mark.parametrize("d", [d for d in DEPLOYMENTS if "spec" in d.get("parameters", {})],
                         ids=lambda d: d["name"])
def test_a_value_edited_in_the_form_reaches_the_flow_and_a_wrong_type_is_refused_naming_its_field(d):
    flow, schema = _form(d)
    edited = copy.deepcopy(d["parameters"])
    edited["spec"].setdefault("optim", {})["lr"] = 0.0123
    edited["spec"].setdefault("stages", {}).setdefault("full", {})["max_steps"] = 7
    validate(edited, schema, raise_on_error=True)
    spec = flow.validate_parameters(edited)["spec"]
    assert (spec.optim.lr, spec.stages.full.max_steps) == (0.0123, 7)

    edited["spec"]["optim"]["lr"] = "fast"
    with pytest.raises(ValidationError, match="spec.optim.lr"):
        validate(edited, schema, raise_on_error=True)


def _as_jsonb(value):
    """``value`` with every object's keys in PostgreSQL JSONB's order (shorter keys first, then bytewise), as
    a PostgreSQL-backed Prefect server returns a deployment's schema."""
    if isinstance(value, dict):
        return {k: _as_jsonb(value[k]) for k in sorted(value, key=lambda k: (len(k.encode()), k.encode()))}
    if isinstance(value, list):
        return [_as_jsonb(v) for v in value]
    return value


def _form_order(obj: dict) -> list[str]:
    """The fields of one object in the order the Prefect UI's form shows them: by ``position``, a field
    without one after those with one (its SchemaFormFields sort)."""
    return sorted(obj["properties"], key=lambda k: obj["properties"][k].get("position", float("inf")))


@pytest.mark.parametrize("d", DEPLOYMENTS, ids=[d["name"] for d in DEPLOYMENTS])
def test_every_deployments_form_shows_its_fields_in_declared_order_from_a_postgresql_server(d):
    flow, declared = _form(d)
    stored = _as_jsonb(declared)
    assert _form_order(stored) == list(inspect.signature(flow.fn).parameters)
    objects = {name: obj for name, obj in declared["definitions"].items() if obj.get("properties")}
    for name, obj in objects.items():  # pydantic writes a model's properties in their declared order
        assert _form_order(stored["definitions"][name]) == list(obj["properties"]), name
    if "spec" in declared["properties"]:
        assert _form_order(stored["definitions"]["RunSpec"]) == list(RunSpec.model_fields)
        assert list(stored["definitions"]["RunSpec"]["properties"]) != list(RunSpec.model_fields)  # JSONB reorders
