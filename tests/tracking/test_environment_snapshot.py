"""A run's environment names the torch build it trains with, read without importing torch."""

from __future__ import annotations

import json
import subprocess

import torch
from tgtest import PYTHON, ROOT

_PROBE = """
import json, sys
from traingate.tracking.identity import environment_snapshot
s = environment_snapshot()
print(json.dumps({"torch": s["torch"], "cuda": s["cuda"], "cudnn": s["cudnn"], "imported": "torch" in sys.modules}))
"""


def test_the_environment_snapshot_names_the_torch_build_without_importing_torch():
    p = subprocess.run([PYTHON, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    snap = json.loads(p.stdout)
    assert snap == {
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "cudnn": "none" if torch.version.cuda is None else snap["cudnn"],  # a CPU build loads no cuDNN
        "imported": False,
    }


def test_installed_packages_are_read_once_until_a_directory_on_the_path_changes(tmp_path, monkeypatch):
    from importlib import metadata

    from traingate.tracking import identity

    monkeypatch.syspath_prepend(str(tmp_path))
    reads = []
    real = metadata.distributions
    monkeypatch.setattr(metadata, "distributions", lambda: reads.append(1) or real())
    before = identity.installed_packages()
    assert "tg-probe-package" not in before and identity.installed_packages() == before and len(reads) == 1
    info = tmp_path / "tg_probe_package-1.2.dist-info"
    info.mkdir()  # an install: a new entry in a directory on the path
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tg-probe-package\nVersion: 1.2\n")
    assert identity.installed_packages()["tg-probe-package"] == "1.2" and len(reads) == 2
