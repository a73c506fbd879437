"""What a torchrun group's agent writes of its own lands in the stage's directory, not the system's temp dir."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_a_torchrun_group_leaves_its_per_rank_files_in_the_stage_dir_and_nothing_in_the_temp_dir(
        supervised, tmp_path, monkeypatch):
    tmp = tmp_path / "system-tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    run = supervised()  # the full stage: 2 ranks under traingate's torchrun agent
    assert run.sup.status == "completed", run.log
    assert [p.name for p in tmp.iterdir() if p.name.startswith("torchelastic_")] == []
    ranks = sorted(p.name for p in (run.stage_dir / "torchelastic").glob("*/attempt_0/*"))
    assert ranks == ["0", "1"]
