"""What the supervisor reads of a stage's checkpoints: the newest one and when it was made, and, when
the disk is full, where and about how much the next one needs."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from traingate.job.catalog import CheckpointCatalog, step_dir
from traingate.job.stagejob import StageJob


def latest_checkpoint(uri: str) -> tuple[int | None, float | None]:
    """The newest checkpoint's step and creation time (None, None: there is none)."""
    ck = CheckpointCatalog(uri)
    steps = ck.list_steps()
    if not steps:
        return None, None
    return steps[-1], float(ck.manifest(steps[-1]).get("created") or 0.0) or None


def is_disk_full(e: OSError | None) -> bool:
    return e is not None and e.errno in (errno.ENOSPC, errno.EDQUOT)


def no_block_left(path: Path) -> OSError | None:
    """ENOSPC when the filesystem holding ``path`` has not one free block, for any user (root included):
    no heartbeat, last words or new log page can be written there. Ranks that cannot leave last words
    are otherwise restarted in place by torchrun until the log itself fails to grow."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None  # not there yet (the launch creates it): nothing to judge
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) if st.f_bfree == 0 else None


def disk_full_detail(job: StageJob) -> str:
    """Which of the stage's local locations is full, and about how much it needs (one line)."""
    ckpt_dir = job.checkpoint_uri.removeprefix("file://") if job.checkpoint_uri.startswith("file://") else None
    places = [("the state directory (TRAINGATE_STATE_DIR)", Path(job.stage_dir))]
    if ckpt_dir:
        places.append(("the checkpoint store (checkpoint.uri / TRAINGATE_CHECKPOINT_URI)", Path(ckpt_dir)))
    # A checkpoint is written beside the previous one before retention removes it: about one more of its size.
    step = CheckpointCatalog(job.checkpoint_uri).find_latest(verify=False) if ckpt_dir else None
    need = _tree_bytes(Path(ckpt_dir) / step_dir(step)) if step is not None and ckpt_dir else 0
    name, where, free = min(((n, p, _free(p)) for n, p in places), key=lambda x: x[2])
    # Sized by the newest checkpoint (the next one is written beside it); before the first checkpoint
    # there is nothing to size it by, and only a lower bound is honest.
    needs = f"needs about {need / 2**20:.1f} MiB more (one checkpoint)" if need else "needs at least 1.0 MiB more"
    return (
        f"no space left on device in {name} at {where}: {free / 2**20:.1f} MiB free, {needs}; "
        f"free space there or point it at a larger disk, then continue with `traingate resume {job.run_id}`"
    )


def _free(path: Path) -> int:
    for p in (path, *path.parents):
        if p.exists():
            return shutil.disk_usage(p).free
    return 0


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0
