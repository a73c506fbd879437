"""Trace columns for where a job may run (pools, GPU types) and for shared-GPU (fractional) requests."""

from __future__ import annotations

import pytest

from traingate.capacity.pools import CapacityError, parse_config
from traingate.capacity.trace import read_trace

POOL = {"gpus_per_node": 8, "nodes": 2, "price_per_gpu_hour": 1.0, "worker": "docker"}
CFG = parse_config(
    {
        "pools": {
            "a100-east": {**POOL, "gpu": "A100"},
            "a100-west": {**POOL, "gpu": "A100"},
            "h100": {**POOL, "gpu": "H100", "nodes": 1},
        }
    }
)


def read(tmp_path, text):
    path = tmp_path / "t.csv"
    path.write_text(text)
    return read_trace(path, CFG)


def test_a_pools_column_lists_the_pools_a_job_accepts_the_first_being_its_own(tmp_path):
    a, b = read(tmp_path, "job_id,submit_s,duration_s,gpus,pools\nj1,0,60,2,h100|a100-west\nj2,0,60,1,h100\n")
    assert (a.job.pool, a.accepts) == ("h100", ("h100", "a100-west"))
    assert (b.job.pool, b.pools, b.accepts) == ("h100", (), ("h100",))


def test_a_gpu_types_column_maps_each_gpu_model_to_every_pool_of_that_model(tmp_path):
    (tj,) = read(tmp_path, "job_id,submit_s,duration_s,gpus,gpu_types\nj1,0,60,2,A100|H100\n")
    assert tj.accepts == ("a100-east", "a100-west", "h100")


def test_shared_gpu_requests_keep_their_fraction_in_thousandths_of_one_slot(tmp_path):
    a, b = read(tmp_path, "job_id,submit_s,duration_s,gpus,pool\nj1,0,60,0.25,h100\nj2,0,60,4,h100\n")
    assert (a.gpus, a.job.slots, a.job.milli) == (0.25, 1, 250)
    assert (b.gpus, b.job.slots, b.job.milli) == (None, 4, 0)


BAD = [
    ("job_id,submit_s,duration_s,gpus,pools\nj1,0,60,1,h100|a10\n",
     "t.csv line 2: pools = 'h100|a10': 'a10' is not in the pools config; use some of ['a100-east', "),
    ("job_id,submit_s,duration_s,gpus,pools\nj1,0,60,1,\n", "t.csv line 2: pools = '': an empty entry; list them"),
    ("job_id,submit_s,duration_s,gpus,pools\nj1,0,60,1,h100||a100-east\n",
     "line 2: pools = 'h100||a100-east': an empty"),
    ("job_id,submit_s,duration_s,gpus,gpu_types\nj1,0,60,1,V100\n",
     "line 2: gpu_types = 'V100': no pool has GPU 'V100'; the pools' GPUs are ['A100', 'H100']"),
    ("job_id,submit_s,duration_s,gpus,pools\nj1,0,60,16,a100-east|h100\n",
     "line 2: gpus = '16': 16 GPUs do not fit pool 'h100', which has 8"),
    ("job_id,submit_s,duration_s,gpus,pool,pools\nj1,0,60,1,h100,h100\n",
     "line 1: columns 'pool' and 'pools' both say where a job runs; keep one"),
    ("job_id,submit_s,duration_s,gpus,pool\nj1,0,60,1.5,h100\n",
     "line 2: gpus = '1.5': a request above one GPU is whole GPUs (a fraction below 1 shares a GPU); round up to 2"),
    ("job_id,submit_s,duration_s,gpus,pool\nj1,0,60,0,h100\n", "line 2: gpus = '0': must be > 0"),
]


@pytest.mark.parametrize(("text", "line"), BAD)
def test_bad_pools_or_fractions_are_one_line_naming_the_row_and_column(tmp_path, text, line):
    with pytest.raises(CapacityError) as e:
        read(tmp_path, text)
    assert line in str(e.value) and "\n" not in str(e.value)
