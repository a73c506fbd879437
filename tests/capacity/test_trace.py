"""Trace CSV: defaults, one-line errors naming line, column, value and fix; the generator's shape."""
from __future__ import annotations

import codecs

import numpy as np
import pytest

from traingate.capacity.pools import CapacityError, parse_config
from traingate.capacity.trace import TraceParams, generate, generate_jobs, read_trace, write_trace

POOL = {"gpus_per_node": 8, "nodes": 2, "price_per_gpu_hour": 1.0, "worker": "process"}
ONE = parse_config({"pools": {"p": POOL}, "quotas": {"vision": {"p": 8}}, "simulator": {"checkpoint_every_s": 600}})
TWO = parse_config({"pools": {"p": POOL, "q": POOL}})


def read(tmp_path, text, cfg=ONE, pool=None):
    path = tmp_path / "t.csv"
    path.write_text(text)
    return read_trace(path, cfg, pool)


def test_optional_columns_default_to_team_default_the_default_class_and_the_only_pool(tmp_path):
    (tj,) = read(tmp_path, "job_id,submit_s,duration_s,gpus\nj1,0,60,2\n")
    assert (tj.job.team, tj.job.priority, tj.job.pool, tj.job.slots, tj.duration_s) == ("default", "research", "p", 2, 60.0)
    assert tj.job.est_duration_s is None and tj.job.checkpoint_every_s == 600


def test_the_estimate_column_is_read_and_an_empty_cell_means_no_estimate(tmp_path):
    jobs = read(tmp_path, "job_id,submit_s,duration_s,gpus,est_duration_s\nj1,0,60,1,45\nj2,1,60,1,\n")
    assert [tj.job.est_duration_s for tj in jobs] == [45.0, None]


@pytest.mark.parametrize("text, message", [
    ("job_id,submit_s,gpus\n", "line 1: column 'duration_s' is missing"),
    ("job_id,submit_s,duration_s,gpus,user\n", "line 1: column 'user' is not a trace column"),
    ("job_id,submit_s,duration_s,gpus\nj1,0,60,two\n", "line 2: gpus = 'two': not a number"),
    ("job_id,submit_s,duration_s,gpus\nj1,-5,60,1\n", "line 2: submit_s = '-5': must be >= 0"),
    ("job_id,submit_s,duration_s,gpus\nj1,0,0,1\n", "line 2: duration_s = '0': must be > 0"),
    ("job_id,submit_s,duration_s,gpus\nj1,0,60,1\nj1,1,60,1\n", "line 3: job_id = 'j1': appears twice"),
    ("job_id,submit_s,duration_s,gpus\nj1,0,60\n", "line 2: 3 fields, the header has 4"),
    ("job_id,submit_s,duration_s,gpus,priority\nj1,0,60,1,vip\n", "line 2: priority = 'vip': not a priority class"),
    ("job_id,submit_s,duration_s,gpus,pool\nj1,0,60,1,gpu-x\n", "line 2: pool = 'gpu-x': not in the pools config"),
    ("job_id,submit_s,duration_s,gpus\nj1,0,60,24\n", "line 2: gpus = '24': 24 GPUs do not fit pool 'p', which has 16"),
    ("job_id,submit_s,duration_s,gpus,team\nj1,0,60,16,vision\n", "exceed the quota of team 'vision' on 'p' (8)"),
    ("job_id,submit_s,duration_s,gpus,team\nj1,0,60,1,\n", "line 2: team = '': empty"),
    ("job_id,submit_s,duration_s,gpus\n", "no jobs after the header"),
    ("", "empty file"),
])
def test_a_bad_trace_is_one_line_naming_line_column_value_and_fix(tmp_path, text, message):
    with pytest.raises(CapacityError) as e:
        read(tmp_path, text)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_without_a_pool_column_several_pools_need_a_default_pool(tmp_path):
    with pytest.raises(CapacityError, match=r"no `pool` column and the config has pools \['p', 'q'\]; pass --pool"):
        read(tmp_path, "job_id,submit_s,duration_s,gpus\nj1,0,60,1\n", TWO)
    (tj,) = read(tmp_path, "job_id,submit_s,duration_s,gpus\nj1,0,60,1\n", TWO, pool="q")
    assert tj.job.pool == "q"


def test_a_written_trace_reads_back(tmp_path):
    rows = generate(TraceParams(n_jobs=50, capacity=16, seed=3))
    jobs = read_trace(write_trace(tmp_path / "g.csv", rows), ONE.model_copy(update={"quotas": {}}))
    assert [(tj.job.job_id, tj.job.slots, tj.duration_s) for tj in jobs] == \
        [(r["job_id"], r["gpus"], r["duration_s"]) for r in rows]


def test_the_generator_follows_the_published_shape_and_is_deterministic():
    p = TraceParams(n_jobs=3000, seed=1)
    rows = generate(p)
    assert rows == generate(p) and rows != generate(TraceParams(n_jobs=3000, seed=2))
    gpus = np.array([r["gpus"] for r in rows])
    dur = np.array([r["duration_s"] for r in rows])
    large = gpus > p.gpus_per_node
    assert large.mean() == pytest.approx(0.032, abs=0.0005)                          # Hu et al.: 3.2% of jobs ...
    assert (gpus * dur)[large].sum() / (gpus * dur).sum() == pytest.approx(0.94, abs=0.005)  # ... 94% of GPU time
    assert (gpus == 1).mean() > 0.5                                                   # Weng et al.: mostly <= 1 GPU
    assert set(gpus[large]) == {16, 32}                                               # whole nodes, <= half the pool
    assert {r["priority"] for r, l in zip(rows, large) if l} <= {"production", "research"}
    submits = np.array([r["submit_s"] for r in rows])
    assert (np.diff(submits) >= 0).all()
    offered = (gpus * dur).sum() / (p.capacity * (submits[-1] - submits[0]))
    assert offered == pytest.approx(p.load, rel=0.05)


def test_about_two_thirds_of_generated_jobs_recur_with_their_templates_team_class_and_size():
    jobs = generate_jobs(TraceParams(n_jobs=5000, seed=4))
    recurring = [j for j in jobs if j["template"] is not None]
    assert len(recurring) / len(jobs) == pytest.approx(0.65, abs=0.02)          # Weng et al.
    by_template: dict = {}
    for j in recurring:
        by_template.setdefault(j["template"], []).append(j)
    for group in by_template.values():
        assert len({(j["team"], j["priority"], j["gpus"]) for j in group}) == 1
    spread = [np.std(np.log([j["duration_s"] for j in g])) for g in by_template.values() if len(g) > 20]
    assert 0.05 < np.median(spread) < 0.15                                      # recur_jitter 0.1


H = b"job_id,submit_s,duration_s,gpus\n"
BAD_INPUT = {
    "latin-1 byte": (H + b"j1,0,60,1\nj\xe9,1,60,1\n", "line 3: job_id: byte b'\\xe9' is not UTF-8"),
    "latin-1 after a BOM": (codecs.BOM_UTF8 + H + b"j1,0,6\xb50,1\n", "line 2: duration_s: byte b'\\xb5' is not UTF-8"),
    "UTF-16": ("job_id,submit_s,duration_s,gpus\nj1,0,60,1\n".encode("utf-16"), "line 1: the file is UTF-16"),
    "mixed delimiters": (b"job_id;submit_s;duration_s;gpus\nj1,0,60,1\n",
                         "line 2: 1 field, the header has 4: this line is separated by commas, the header by semicolons"),
    "decimal comma": (b"job_id;submit_s;duration_s;gpus\nj1;0;12,5;1\n", "line 2: duration_s = '12,5': not a number"),
    "no trace column": (b"a|b\n1|2\n", "line 1: the header 'a|b' names no trace column"),
    "blank header": (b"\n" + H + b"j1,0,60,1\n", "line 1: blank; the first line is the header"),
    "missing column": (b"job_id,submit_s,gpus\nj1,0,1\n", "line 1: column 'duration_s' is missing"),
    "unnamed column": (b"job_id,submit_s,duration_s,gpus,\nj1,0,60,1,\n", "line 1: column 5 has no name"),
    "short row": (H + b"j1,0,60\n", "line 2: 3 fields, the header has 4: column 'gpus' is missing"),
    "long row": (H + b"j1,0,60,1,x\n", "line 2: 5 fields, the header has 4: field 5 ('x') has no column"),
    "unclosed quote": (H + b'j1,0,60,1\nj2,"0,1\n', "line 3: not CSV"),
    "NUL byte": (H + b"j1,0\x00,60,1\n", "line 2: submit_s = '0\\x00': not a number"),
    "negative": (H + b"j1,-5,60,1\n", "line 2: submit_s = '-5': must be >= 0"),
    "NaN": (H + b"j1,0,nan,1\n", "line 2: duration_s = 'nan': not a finite number"),
    "inf": (H + b"j1,inf,60,1\n", "line 2: submit_s = 'inf': not a finite number"),
    "infinite estimate": (b"job_id,submit_s,duration_s,gpus,est_duration_s\nj1,0,60,1,inf\n",
                          "line 2: est_duration_s = 'inf': not a finite number"),
    "NaN GPUs": (H + b"j1,0,60,nan\n", "line 2: gpus = 'nan': not a plausible GPU count"),
    "overflowing GPUs": (H + b"j1,0,60,1e400\n", "line 2: gpus = '1e400': not a plausible GPU count"),
    "milliseconds": (H + b"j1,1.7e12,60,1\n", "line 2: submit_s = '1.7e12': over 10,000,000,000 s"),
    "absurd duration": (H + b"j1,0,6e9,1\n", "line 2: duration_s = '6e9': over 31,622,400 s"),
    "empty": (b"", "empty file"),
    "whitespace only": (b"  \n\n", "empty file"),
}


@pytest.mark.parametrize("data, message", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_malformed_bytes_are_one_line_naming_line_and_column(tmp_path, data, message):
    path = tmp_path / "t.csv"
    path.write_bytes(data)
    with pytest.raises(CapacityError) as e:
        read_trace(path, ONE)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("data", [
    codecs.BOM_UTF8 + H + b"j1,0,60,1\n",
    b"job_id;submit_s;duration_s;gpus\nj1;0;60;1\n",
    b"job_id\tsubmit_s\tduration_s\tgpus\r\nj1\t0\t60\t1\r\n",
    b"job_id;submit_s;duration_s;gpus\rj1;0;60;1\r",
], ids=["UTF-8 BOM", "semicolons", "tabs and CRLF", "semicolons and CR"])
def test_a_utf8_bom_is_skipped_and_semicolon_or_tab_delimiters_are_detected(tmp_path, data):
    path = tmp_path / "t.csv"
    path.write_bytes(data)
    (tj,) = read_trace(path, ONE)
    assert (tj.job.job_id, tj.job.submit_s, tj.duration_s, tj.job.slots) == ("j1", 0.0, 60.0, 1)


def test_unix_epoch_submissions_are_plausible(tmp_path):
    (tj,) = read(tmp_path, "job_id,submit_s,duration_s,gpus\nj1,1700000000.25,60,1\n")
    assert tj.job.submit_s == 1700000000.25


def test_a_folder_or_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(CapacityError, match=r"is not a file; pass a CSV with columns job_id,submit_s,duration_s,gpus$"):
        read_trace(tmp_path, ONE)
    with pytest.raises(CapacityError, match=r"does not exist; pass a CSV"):
        read_trace(tmp_path / "nope.csv", ONE)
