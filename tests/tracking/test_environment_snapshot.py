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
