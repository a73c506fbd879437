"""`traingate simulate` on small traces: the command module, and once through the `traingate` CLI."""
from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from flows.cli import arguments
from flows.cli import simulate as command
from tgtest import PYTHON, ROOT

POOLS = str(ROOT / "examples" / "pools.yaml")


def main(argv: list[str]) -> int:
    # The command alone, in this process: its arguments and its main, without the CLI's environment set-up.
    p = argparse.ArgumentParser()
    arguments.simulate(p)
    return command.main(p.parse_args(argv[1:]))


def test_simulate_prints_the_comparison_and_writes_table_plots_and_schedules(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    rc = main(["simulate", str(trace), "--pools", POOLS, "--pool", "gpu-h100", "--generate", "120", "--seed", "3",
               "--policies", "fifo,fairshare+aged+backfill+preempt", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "generated 120 jobs" in out and "| fifo | " in out and "fairshare+aged+backfill+preempt" in out
    assert "| 1.00 | 1.00 |" in out          # FIFO against itself
    assert "| fairshare+aged+backfill+preempt (config default) | " in out
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == ["figures.csv", "ratios.png", "schedule-fairshare+aged+backfill+preempt.csv",
                       "schedule-fifo.csv", "table.md", "team_share.png", "timeseries-fairshare+aged+backfill+preempt.csv",
                       "timeseries-fifo.csv", "timeseries.png", "wait_cdf.png", "waits_by_size.csv"]
    assert (tmp_path / "out" / "wait_cdf.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "out" / "timeseries.png").read_bytes()[:4] == b"\x89PNG"
    assert len((tmp_path / "out" / "schedule-fifo.csv").read_text().splitlines()) == 121
    assert len((tmp_path / "out" / "timeseries-fifo.csv").read_text().splitlines()) == 1 + 2 * 1000  # pool, all
    assert len((tmp_path / "out" / "figures.csv").read_text().splitlines()) == 1 + 2 * 2  # policies x (pool, all)
    assert "| fifo | gpu-h100 | 120 | " in out and "Queueing delay by job size" in out


def test_the_traingate_cli_exits_2_on_a_bad_trace_with_one_line_and_writes_nothing(tmp_path):
    trace = tmp_path / "bad.csv"
    trace.write_text("job_id,submit_s,duration_s,gpus\nj1,0,60,1\nj2,5,abc,1\n")
    p = subprocess.run([str(Path(PYTHON).parent / "traingate"), "simulate", str(trace), "--pools", POOLS,
                        "--pool", "gpu-a100", "--out", str(tmp_path / "out")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        f"traingate simulate: {trace} line 3: duration_s = 'abc': not a number; write seconds like 3600 or 12.5"]
    assert not (tmp_path / "out").exists()


def test_generate_refuses_to_overwrite_a_trace(tmp_path, capsys):
    trace = tmp_path / "real.csv"
    trace.write_text("job_id,submit_s,duration_s,gpus\nj1,0,60,1\n")
    assert main(["simulate", str(trace), "--pools", POOLS, "--pool", "gpu-a100", "--generate", "10"]) == 2
    assert "would overwrite" in capsys.readouterr().err
    assert trace.read_text() == "job_id,submit_s,duration_s,gpus\nj1,0,60,1\n"


def test_an_unknown_policy_exits_2_naming_the_choices(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("job_id,submit_s,duration_s,gpus\nj1,0,60,1\n")
    assert main(["simulate", str(trace), "--pools", POOLS, "--pool", "gpu-a100", "--policies", "fifo,edf"]) == 2
    assert "policy 'edf': 'edf' is not an order; use one of ['fifo', 'priority', 'sjf', 'fairshare', 'multifactor', 'hrrn']" in capsys.readouterr().err


H = b"job_id,submit_s,duration_s,gpus\n"


@pytest.mark.parametrize("data, message", [
    (H + b"j1,0,60,1\nj2,1,6\xe90,1\n", "line 3: duration_s: byte b'\\xe9' is not UTF-8"),
    ("job_id,submit_s\n".encode("utf-16"), "line 1: the file is UTF-16"),
    (b"job_id;submit_s;duration_s;gpus\nj1,0,60,1\n", "this line is separated by commas, the header by semicolons"),
    (b"job_id,submit_s,gpus\nj1,0,1\n", "line 1: column 'duration_s' is missing"),
    (H + b"j1,0,60,1,x\n", "line 2: 5 fields, the header has 4: field 5 ('x') has no column"),
    (H + b"j1,0,60\n", "line 2: 3 fields, the header has 4: column 'gpus' is missing"),
    (H + b"j1,-1,60,1\n", "line 2: submit_s = '-1': must be >= 0"),
    (H + b"j1,0,nan,1\n", "line 2: duration_s = 'nan': not a finite number"),
    (H + b"j1,0,60,1e400\n", "line 2: gpus = '1e400': not a plausible GPU count"),
    (H + b"j1,0,6e9,1\n", "line 2: duration_s = '6e9': over 31,622,400 s"),
    (b"", "empty file"),
], ids=["latin-1", "utf-16", "delimiter", "missing column", "extra field", "short row", "negative", "nan", "inf",
        "absurd", "empty"])
def test_each_kind_of_malformed_trace_exits_2_with_one_line_and_starts_nothing(tmp_path, capsys, data, message):
    trace = tmp_path / "t.csv"
    trace.write_bytes(data)
    rc = main(["simulate", str(trace), "--pools", POOLS, "--pool", "gpu-a100", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"traingate simulate: {trace}") and message in err
    assert not (tmp_path / "out").exists()
