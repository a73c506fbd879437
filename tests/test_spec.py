"""A bad spec gets one line naming the field, the value and the fix; nothing starts."""
from __future__ import annotations

import pytest
import yaml
from tgtest import TINY_DIGITS

from traingate.ladder.preflight import check_spec
from traingate.spec import SpecError, apply_overrides, load_spec, load_spec_text

# (overrides applied to the tiny digits spec, or a raw YAML text) -> a field the message must name
MALFORMED = [
    (["optim.lr=abc"], "optim.lr"),
    (["optim.lr=-0.1"], "optim.lr"),
    (["optim.batch_size=0"], "optim.batch_size"),
    (["optim.batch_size=2.5"], "optim.batch_size"),
    (["optim.schedule=linearish"], "optim.schedule"),
    (["optim.learning_rate=0.1"], "optim.learning_rate"),
    (["stages.canary.max_steps=-5"], "stages.canary.max_steps"),
    (["stages.full.max_steps=0"], "stages.full.max_steps"),
    (["stages.smoke.max_samples=100000"], "stages.smoke.max_samples"),
    (["stages.smoke.max_steps=1"], "stages.smoke.max_steps"),
    (["stages.warmup={max_steps: 3}"], "stages.warmup"),
    (["recipe.name=resnet-9000"], "recipe.name"),
    (["recipe.params.channels=-1"], "recipe.params.channels"),
    (["recipe.params.colour=red"], "recipe.params.colour"),
    (["resources.work_pool=gpu-z9000"], "resources.work_pool"),
    (["resources.procs_per_node=0"], "resources.procs_per_node"),
    (["resources.nodes=2"], "rdzv_endpoint"),
    (["resources.work_pool=gpu-a100", "resources.procs_per_node=16"], "resources.procs_per_node"),
    (["identity.owner="], "identity.owner"),
    (["identity.purpose=null"], "identity.purpose"),
    (["gates.canary.rules=[{metric: loss, op: '~', value: 1}]"], "gates.canary.rules.0.op"),
    (["gates.deploy={rules: []}"], "gates.deploy"),
    (["checkpoint.keep_last=0"], "checkpoint.keep_last"),
    (["checkpoint.uri=/not/a/uri"], "checkpoint.uri"),
    (["data.val_fraction=1.5"], "data.val_fraction"),
    (["optim.batch_size=1000"], "optim.batch_size"),
    (["budget.max_cost_usd=-1"], "budget.max_cost_usd"),
    (["tracking.log_every=0"], "tracking.log_every"),
    (["recipe.name=char-gpt", "data.uri=file:///nonexistent/corpus.txt", "recipe.params={}"], "data.uri"),
    (["recipe.name=char-gpt", "recipe.params={n_embd: 30, n_head: 4}"], "recipe.params.n_embd"),
    (["recipe.name=script"], "recipe"),
    (["recipe={name: script, script: {command: [python, nope.py], workdir: /nonexistent}}"], "recipe.script.workdir"),
    (["recipe={name: script, script: {command: [python, train.py], metrics: ['loss=(\\d']}}"], "recipe.script.metrics"),
    (["optim=3"], "optim"),
]


def _load(overrides):
    return load_spec_text(TINY_DIGITS, overrides)


@pytest.mark.parametrize("overrides,field", MALFORMED, ids=[",".join(o) for o, _ in MALFORMED])
def test_malformed_spec_names_the_field_in_one_line(overrides, field):
    with pytest.raises(SpecError) as err:
        check_spec(_load(overrides))
    msg = str(err.value)
    assert field in msg
    assert "\n" not in msg
    assert len(msg) < 400


def test_at_least_twenty_distinct_malformed_specs_are_covered():
    assert len({f for _, f in MALFORMED}) >= 20


@pytest.mark.parametrize("text,needle", [
    ("identity: [unclosed", "not valid YAML"),
    ("- a list\n- not a mapping", "top level must be a mapping"),
    ("", "identity"),
    ("identity: {experiment: e, owner: o, team: t, purpose: p}\n", "recipe"),
])
def test_unparseable_or_empty_specs_are_rejected(text, needle):
    with pytest.raises(SpecError, match=needle):
        load_spec_text(text)


def test_overrides_parse_yaml_scalars_and_scientific_notation():
    tree = apply_overrides({}, ["optim.lr=3e-4", "tracking.enabled=false", "a.b=[1, 2]", "x=hello"])
    assert tree == {"optim": {"lr": 3e-4}, "tracking": {"enabled": False}, "a": {"b": [1, 2]}, "x": "hello"}


def test_override_without_equals_sign_is_a_clear_error():
    with pytest.raises(SpecError, match="expected key=value"):
        _load(["optim.lr"])


def test_missing_spec_file_is_a_clear_error(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "nope.yaml")


def test_valid_spec_resolves_defaults_and_hash_is_stable(tiny_spec):
    a = load_spec(tiny_spec())
    b = load_spec_text(yaml.safe_dump(a.to_dict()))
    assert a.spec_hash() == b.spec_hash()
    assert a.checkpoint.keep_last == 3 and a.world_size == 2
    assert check_spec(a)["canary"] == a.stages.canary.max_samples or 1617


def test_cli_rejects_bad_spec_with_exit_2_and_starts_nothing(tiny_spec, state_dir, capsys):
    from flows.cli import main

    # In this process: a refusal comes before anything heavy is imported (a refused `traingate` process:
    # tests/test_hostile_specs.py).
    spec = tiny_spec()
    for args in (["validate", str(spec), "--set", "optim.lr=-1"],
                 ["run", str(spec), "--set", "recipe.name=nope"],
                 ["run", str(spec), "--set", "stages.smoke.max_samples=99999", "--dry-run"]):
        code = main(args)
        err = capsys.readouterr().err
        assert code == 2, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("traingate: invalid spec:"), err
    assert not state_dir.exists(), "a rejected spec must not create runs, databases or checkpoints"


def test_cli_validate_prints_the_resolved_spec(tiny_spec, capsys):
    from flows.cli import main

    code = main(["validate", str(tiny_spec()), "--set", "optim.lr=0.5"])
    out, err = capsys.readouterr()
    assert code == 0, err
    resolved = yaml.safe_load(out)
    assert resolved["optim"]["lr"] == 0.5 and resolved["checkpoint"]["keep_last"] == 3


def test_yaml_anchors_and_merge_keys_still_work_while_duplicates_are_refused():
    text = TINY_DIGITS + "pools:\n  a: &base {price_per_gpu_hour: 1.0, gpus_per_node: 0}\n  b: {<<: *base, price_per_gpu_hour: 2.0}\n"
    spec = load_spec_text(text, ["resources.work_pool=b"])
    assert spec.pools["a"].price_per_gpu_hour == 1.0 and spec.pools["b"].price_per_gpu_hour == 2.0
    with pytest.raises(SpecError, match=r"pools\.b\.price_per_gpu_hour = '3.0': duplicate key"):
        load_spec_text(text.replace("price_per_gpu_hour: 2.0}", "price_per_gpu_hour: 2.0, price_per_gpu_hour: 3.0}"))


@pytest.mark.parametrize("overrides, warm", [
    ([], True),  # cpu-local: no GPUs per node
    (["resources.work_pool=gpu-a100"], False),
    (["supervision.warm_restarts=false"], False),
    (["resources.work_pool=gpu-a100", "supervision.warm_restarts=true"], True),
    (["pools.cpu-local.gpus_per_node=4"], False),  # the pool as the spec describes it, not its name
])
def test_warm_restarts_unset_are_on_for_a_cpu_pool_and_off_for_a_gpu_pool_and_a_given_value_wins(overrides, warm):
    spec = load_spec_text(TINY_DIGITS).with_overrides(overrides)
    assert spec.warm_restarts is warm
