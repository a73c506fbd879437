"""Run identity: who, why, which code, which data, which environment."""
from __future__ import annotations

import hashlib
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

# A run without every one of these (plus the spec params and the spec and environment
# artifacts, see traingate.tracking.runs.identity_problems) is not valid and is not promoted.
REQUIRED_TAGS = ("traingate.run_id", "traingate.experiment", "traingate.owner", "traingate.team",
                 "traingate.purpose", "traingate.recipe", "traingate.code_version", "traingate.code_dirty",
                 "traingate.data_snapshot", "traingate.data_uri", "traingate.spec_hash")


def code_version(path: str | Path = ".") -> dict[str, str]:
    """git sha + dirty flag (+ a hash of the diff when dirty); 'unknown' outside a git tree."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=path, capture_output=True, text=True, timeout=30,
                              check=True).stdout
    try:
        sha = git("rev-parse", "HEAD").strip()
    except (subprocess.CalledProcessError, FileNotFoundError, subprocess.TimeoutExpired):
        return {"sha": "unknown", "dirty": "unknown", "diff_hash": ""}
    diff = git("diff", "HEAD")
    untracked = git("ls-files", "--others", "--exclude-standard")
    dirty = bool(diff.strip() or untracked.strip())
    return {"sha": sha, "dirty": str(dirty).lower(),
            "diff_hash": hashlib.sha256((diff + untracked).encode()).hexdigest()[:16] if dirty else ""}


def hash_file_uri(uri: str) -> str:
    import fsspec

    h = hashlib.sha256()
    with fsspec.open(uri, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def environment_snapshot() -> dict[str, Any]:
    import torch

    snap: dict[str, Any] = {
        "python": sys.version.split()[0], "platform": platform.platform(), "hostname": socket.gethostname(),
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "none",
        "packages": sorted(f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()
                           if d.metadata["Name"]),
    }
    snap["gpus"] = gpu_inventory()
    return snap


def gpu_inventory() -> list[dict[str, Any]]:
    """GPU model and driver via NVML; an empty list where there is no NVIDIA driver (a normal state)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound etc.: no GPU here, not an error
        return []
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            out.append({"index": i, "name": pynvml.nvmlDeviceGetName(h), "driver": driver,
                        "memory_mb": pynvml.nvmlDeviceGetMemoryInfo(h).total // 2**20})
        return out
    finally:
        pynvml.nvmlShutdown()
