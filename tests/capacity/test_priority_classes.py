"""resources.priority is one of the priority classes of the pools file (an enum the file defines; without one,
the built-in urgent, production, research). `traingate validate`, `traingate run` and the ladder (on a local and
on a Slurm pool, whose classes are its QOS) refuse any other in one line naming the field, the value and the
classes there are."""
from __future__ import annotations

import pytest
import yaml

from traingate.capacity.pools import BUILTIN_CLASSES, CapacityError, parse_config, priority_class

POOLS = {
    "pools": {
        "cpu-local": {"gpus_per_node": 2, "nodes": 1, "price_per_gpu_hour": 0.05, "worker": "process"},
        "gpu-cluster": {"gpus_per_node": 2, "nodes": 2, "price_per_gpu_hour": 2.5, "worker": "process",
                        "engine": "slurm", "slurm": {"partition": "gpu"}},
    },
    "priority_classes": {"batch": {"priority": 5}},
}


def _cli(*argv: str) -> int:
    from flows.cli import main as cli

    return cli(list(argv))


def test_the_pools_file_defines_its_classes_as_an_enum_most_important_first_built_ins_included():
    classes = parse_config(POOLS).classes
    assert [c.value for c in classes] == ["urgent", "production", "research", "batch"]
    assert priority_class(parse_config(POOLS), "batch", "pools.yaml") is classes("batch")


def test_validate_refuses_an_unknown_priority_class_in_one_line_naming_the_valid_ones(tiny_spec, capsys):
    assert _cli("validate", str(tiny_spec()), "--set", "resources.priority=urgnet") == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"traingate: invalid spec: resources.priority = 'urgnet': not a priority class of "
                   f"{BUILTIN_CLASSES}; use one of urgent, production, research"), err


def test_validate_with_a_pools_file_accepts_its_own_class_and_names_it_among_the_valid_ones(
        tiny_spec, tmp_path, capsys):
    pools = tmp_path / "pools.yaml"
    pools.write_text(yaml.safe_dump(POOLS))
    assert _cli("validate", str(tiny_spec()), "--pools", str(pools), "--set", "resources.priority=batch") == 0
    capsys.readouterr()
    # without the file, batch is no class
    assert _cli("validate", str(tiny_spec()), "--set", "resources.priority=batch") == 2
    assert "'batch': not a priority class" in capsys.readouterr().err
    assert _cli("validate", str(tiny_spec()), "--pools", str(pools), "--set", "resources.priority=urgnet") == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"'urgnet': not a priority class of {pools}; use one of urgent, production, research, batch")


def test_run_without_a_server_refuses_an_unknown_priority_class_before_anything_starts(tiny_spec, state_dir, capsys):
    assert _cli("run", str(tiny_spec()), "--set", "resources.priority=urgnet") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "resources.priority = 'urgnet'" in err and "use one of urgent" in err, err
    assert not (state_dir / "runs").exists()  # no run, no stage directory


@pytest.fixture
def server_pools(prefect_harness):
    """The harness server carries POOLS as its capacity config (and loses it after the test)."""
    from prefect import get_client

    from tasks import slots

    with get_client(sync_client=True) as c:
        slots.put_variable(c, slots.CONFIG_VAR, parse_config(POOLS).model_dump(mode="json"))
    yield
    with get_client(sync_client=True) as c:
        slots.delete_variable(c, slots.CONFIG_VAR)


@pytest.mark.parametrize("pool", ["cpu-local", "gpu-cluster"])
def test_the_ladder_refuses_a_class_the_servers_pools_config_lacks_on_a_local_and_a_slurm_pool(
        tiny_spec, server_pools, pool):
    from flows.pipeline import check_entitled
    from traingate.spec import load_spec

    spec_pools = "pools: {cpu-local: {gpus_per_node: 0, price_per_gpu_hour: 0.05}, " \
                 "gpu-cluster: {gpus_per_node: 2, price_per_gpu_hour: 2.5}}\n"
    spec = load_spec(tiny_spec(spec_pools), [f"resources.work_pool={pool}", "resources.priority=urgnet"])
    # On the Slurm pool this is refused before any association (sacctmgr) is read.
    with pytest.raises(CapacityError) as e:
        check_entitled(spec)
    assert str(e.value) == ("resources.priority = 'urgnet': not a priority class of Prefect variable traingate-pools; "
                            "use one of urgent, production, research, batch")
    if pool == "cpu-local":  # the file's own class passes
        check_entitled(load_spec(tiny_spec(spec_pools), ["resources.priority=batch"]))
