"""Checks that need more than the spec's own shape: does the data exist, do the limits fit it,
can the command run. All raise SpecError (one line) and none starts a process or writes anything."""
from __future__ import annotations

import shutil
from pathlib import Path

import fsspec

from traingate.job.world import stage_world
from traingate.recipes import SCRIPT, get_recipe
from traingate.spec import TRAINING_STAGES, RunSpec, SpecError

_SCHEMES = {"file", "s3", "memory", "gs", "gcs", "az", "abfs"}


def check_spec(spec: RunSpec) -> dict[str, int]:
    """Validate against the world; return the number of training samples each stage sees."""
    _check_uri("checkpoint.uri", spec.checkpoint.uri)
    if spec.recipe.name == SCRIPT:
        return _check_script(spec)
    recipe = get_recipe(spec)
    n_train = recipe.check_data()
    per_stage = {}
    for stage in TRAINING_STAGES:
        limits = getattr(spec.stages, stage)
        if limits.max_samples is not None and limits.max_samples > n_train:
            raise SpecError(f"stages.{stage}.max_samples = {limits.max_samples}: larger than the {n_train} "
                            f"training samples of {recipe.data_uri()}; lower it or leave it unset")
        n = limits.max_samples or n_train
        nodes, nproc = stage_world(spec, stage)
        world = nodes * nproc
        global_batch = spec.optim.batch_size * spec.optim.grad_accum * world
        if global_batch > n:
            raise SpecError(f"optim.batch_size = {spec.optim.batch_size}: the {stage} stage's global batch "
                            f"{global_batch} (batch_size x grad_accum x {world} processes) exceeds its {n} "
                            f"training samples; lower batch_size or raise stages.{stage}.max_samples")
        per_stage[stage] = n
    if spec.stages.smoke.max_steps < 2:
        raise SpecError(f"stages.smoke.max_steps = {spec.stages.smoke.max_steps}: the smoke stage stops half way "
                        "and resumes, so it needs at least 2 steps")
    return per_stage


def _check_uri(field: str, uri: str | None) -> None:
    if uri is None:
        return
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    if scheme not in _SCHEMES:
        raise SpecError(f"{field} = {uri!r}: needs a URI with one of the schemes {sorted(_SCHEMES)}, "
                        "e.g. file:///abs/path or s3://bucket/prefix")


def _check_script(spec: RunSpec) -> dict[str, int]:
    s = spec.recipe.script
    assert s is not None  # guaranteed by RecipeSpec
    workdir = Path(s.workdir)
    if not workdir.is_dir():
        raise SpecError(f"recipe.script.workdir = {s.workdir!r}: not a directory; give the script's working directory")
    exe = s.command[0]
    if exe not in ("python", "python3") and shutil.which(exe, path=None) is None and not (workdir / exe).exists():
        raise SpecError(f"recipe.script.command[0] = {exe!r}: not found on PATH or in the workdir; fix the command")
    if exe in ("python", "python3") and len(s.command) > 1 and not s.command[1].startswith("-"):
        if not (workdir / s.command[1]).is_file():
            raise SpecError(f"recipe.script.command[1] = {s.command[1]!r}: no such file in {s.workdir!r}")
    for t in s.tests:
        if not (workdir / t.split("::")[0]).exists():
            raise SpecError(f"recipe.script.tests: {t!r} does not exist in {s.workdir!r}; fix the path")
    if spec.data.uri:
        _check_uri("data.uri", spec.data.uri)
        fs, path = fsspec.core.url_to_fs(spec.data.uri)
        if not fs.exists(path):
            raise SpecError(f"data.uri = {spec.data.uri!r}: does not exist; fix the location")
    return {}
