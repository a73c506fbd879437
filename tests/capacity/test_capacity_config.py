"""The pools config: the example loads; bad values are one line naming field, value and fix."""
from __future__ import annotations

import pytest

from tgtest import ROOT
from traingate.capacity.pools import CapacityError, load_config, parse_config

POOL = {"gpus_per_node": 8, "nodes": 2, "price_per_gpu_hour": 2.5, "worker": "docker"}


def test_the_example_config_declares_pools_classes_quotas_and_defaults():
    cfg = load_config(ROOT / "examples" / "pools.yaml")
    assert cfg.pools["gpu-a100"].capacity == 64
    assert sorted(cfg.priority_classes, key=cfg.rank) == ["urgent", "production", "research"]
    assert cfg.priority_classes["urgent"].preempts
    assert cfg.quotas_on("gpu-a100")["vision"] == 48


def test_the_three_classes_always_exist_and_a_config_may_add_one():
    cfg = parse_config({"pools": {"p": POOL}, "priority_classes": {"batch": {"priority": 1}}})
    assert sorted(cfg.priority_classes, key=cfg.rank) == ["urgent", "production", "research", "batch"]


@pytest.mark.parametrize("tree, message", [
    ({"pools": {"p": {**POOL, "nodes": 0}}}, "pools.p.nodes = 0: Input should be greater than or equal to 1"),
    ({"pools": {"p": {**POOL, "worker": "slurm"}}}, "pools.p.worker = 'slurm'"),
    ({"pools": {"p": POOL}, "quotas": {"vision": {"gpu-x": 8}}}, "quotas.vision.gpu-x: 'gpu-x' is not a pool"),
    ({"pools": {"p": POOL}, "quotas": {"vision": {"p": 0}}}, "quotas.vision.p = 0: a quota is at least 1 slot"),
    ({"pools": {"p": POOL}, "priority_classes": {"vip": {"priority": 100}}}, "same as class 'urgent'"),
    ({"pools": {"p": POOL}, "default_class": "vip"}, "default_class = 'vip': not a priority class"),
    ({"pools": {"p": POOL}, "scheduling": {"half_life_h": 0}}, "scheduling.half_life_h = 0"),
    ({"pools": {"p": POOL}, "scheduling": {"starvation_bound_h": -1}}, "scheduling.starvation_bound_h = -1"),
    ({"pools": {"p": POOL}, "schedule": {}}, "schedule = {}: Extra inputs are not permitted"),
])
def test_a_bad_config_is_one_line_naming_the_field_and_the_fix(tree, message):
    with pytest.raises(CapacityError) as e:
        parse_config(tree, "pools.yaml")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("pools.yaml: ")


def test_a_missing_or_broken_file_says_so(tmp_path):
    with pytest.raises(CapacityError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("pools: {a: [\n")
    with pytest.raises(CapacityError, match="is not valid YAML"):
        load_config(tmp_path / "bad.yaml")
