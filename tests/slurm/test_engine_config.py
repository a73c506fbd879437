"""A pool names its capacity engine: local (the default) or slurm with its section; bad values are one line."""
from __future__ import annotations

import pytest

from tgtest import ROOT
from traingate.capacity.pools import CapacityError, Engine, load_config, parse_config

POOL = {"gpus_per_node": 2, "nodes": 2, "price_per_gpu_hour": 1.0, "worker": "process"}


def test_a_pool_without_an_engine_is_scheduled_by_the_local_engine():
    cfg = load_config(ROOT / "examples" / "pools.yaml")
    assert {p.engine for p in cfg.pools.values()} == {Engine.LOCAL}
    assert all(p.slurm is None for p in cfg.pools.values())


def test_a_slurm_pool_keeps_its_partition_gres_type_and_extra_sbatch_args():
    cfg = parse_config({"pools": {"gpu": {**POOL, "engine": "slurm", "slurm": {
        "partition": "gpu", "gres_type": "a100", "sbatch_args": ["--constraint=ib"]}}}})
    pool = cfg.pools["gpu"]
    assert pool.engine == Engine.SLURM
    assert (pool.slurm.partition, pool.slurm.gres_type, pool.slurm.sbatch_args) == ("gpu", "a100", ["--constraint=ib"])
    # What `traingate pools bootstrap` stores on the server reads back the same.
    assert parse_config(cfg.model_dump(mode="json")) == cfg


@pytest.mark.parametrize("pool, message", [
    ({"engine": "kubernetes"}, "pools.p.engine = 'kubernetes': unknown engine 'kubernetes'; use one of local, slurm"),
    ({"engine": "slurm"}, "pools.p: engine: slurm needs a `slurm:` section"),
    ({"slurm": {"partition": "gpu"}}, "a `slurm:` section on an engine: local pool does nothing"),
    ({"engine": "slurm", "slurm": {"partition": "gpu", "sbatch_args": ["exclusive"]}},
     "pools.p.slurm.sbatch_args = ['exclusive']: 'exclusive' is not an sbatch option"),
    ({"engine": "slurm", "slurm": {"partition": "gpu x"}}, "pools.p.slurm.partition = 'gpu x'"),
    ({"engine": "slurm", "slurm": {"partition": "gpu", "qos": "urgent"}}, "pools.p.slurm.qos"),
])
def test_a_bad_engine_config_is_one_line_naming_the_field_and_the_fix(pool, message):
    with pytest.raises(CapacityError) as e:
        parse_config({"pools": {"p": {**POOL, **pool}}}, "pools.yaml")
    assert message in str(e.value) and "\n" not in str(e.value)
