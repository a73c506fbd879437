"""Checks that need more than the spec's own shape. All raise SpecError (one line: field, value,
fix) and none starts a process or writes anything.

Two levels:

- :func:`check_spec` (``traingate validate``, and first thing in ``run``/``sweep``) works
  offline: the spec against the code (the metrics each stage can report, the search space
  against the fields it sets, the URIs' syntax and installed filesystems) and against what the
  recipe reads (char-gpt reads its corpus at ``data.uri``, wherever that is; a script's local
  workdir, command, tests and ``file://`` data).
- :func:`preflight` (``run``/``sweep``, before the first stage) probes every store the run
  will use, read-only: the checkpoint and artifact stores and the state dir could be written
  (nothing is created to find out), the data can be read, the tracking store (and a sweep's
  Optuna storage) answers.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import boto3
import fsspec
import psutil
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

from traingate.job.envvars import SCRIPT_ARG_VARS
from traingate.job.result import PROFILE_METRICS
from traingate.job.world import stage_world
from traingate.places import KINDS, check_local_data, place_problem, special_kind
from traingate.recipes import SCRIPT
from traingate.recipes.facts import RecipeFacts, recipe_facts
from traingate.recipes.script import TOTAL, check_args, check_glob
from traingate.redact import REF, redact
from traingate.secrets import check_refs, resolve
from traingate.settings import S3_ENDPOINT_VAR, Settings
from traingate.spec import STAGES, TRAINING_STAGES, RunSpec, SpecError
from traingate.specbase import url_problem
from traingate.storage import s3_code
from traingate.tracking.identity import _SKIP_DIRS

# Where a checkpoint can live: a store every process of a run (and a later resume) can reach.
_SCHEMES = {"file", "s3", "gs", "gcs", "az", "abfs"}
_S3_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
PROBE_TIMEOUT_S = 5.0

# What each stage can report, as the code produces it; tests/test_hostile_specs.py holds these
# against the real trainer, recipes and outcome readers.
UNIT_METRICS = ("tests_passed", "tests_failed", "tests_skipped")  # outcomes.from_pytest
RUNTIME_METRICS = (
    "nonfinite_steps",
    "max_grad_norm",
    "steps",
    "resumed_from_step",
    "world_size",
    "first_loss",
    "final_loss",
    "loss_decrease_fraction",
)  # the trainer's summary
SUPERVISED_METRICS = ("restarts",)  # every supervised stage, script or built-in
EVAL_METRICS = {"digits-cnn": ("val_loss", "val_accuracy"), "char-gpt": ("val_loss", "val_bits_per_char")}
MANIFEST_METRICS = ("train_loss",)  # what a checkpoint manifest records, so what keep_best can rank by
TRIAL_METRICS = ("cost_usd", "duration_s", "steps")  # added to every sweep trial's results


_VALIDATED: dict[str, dict[str, int]] = {}


def remote_data(spec: RunSpec) -> bool:
    """Whether the spec's data lives off this machine (reading it, even to count samples, is a request)."""
    return bool(spec.data.uri) and _scheme(spec.data.uri or "") not in ("", "file", "builtin")


def check_spec(spec: RunSpec, offline: bool = False) -> dict[str, int]:
    """Validate against the world; return the number of training samples each stage sees.

    Once per spec and process: the CLI validates before it starts a flow (to exit 2 with nothing
    created), the flow validates what a deployment hands it; the same spec is not checked twice.
    ``offline`` (``traingate validate``): nothing is sent anywhere, so remote data is not read and its
    sample counts (the returned mapping) are left out; references are still checked, in memory.
    """
    key = f"{spec.spec_hash()}{'-offline' if offline else ''}"
    if key not in _VALIDATED:
        # Every `${env:NAME}` of the spec, wherever it sits (a script argument, a URI, a notify target, a
        # recipe param): an unset one would otherwise fail a stage, or the alert that needed it, hours in.
        check_refs(spec.to_dict())
        per_stage = _check_world(spec, offline)
        _check_metrics(spec)
        if spec.sweep is not None:
            _check_sweep(spec)
        _VALIDATED[key] = per_stage
    return dict(_VALIDATED[key])


def _check_world(spec: RunSpec, offline: bool = False) -> dict[str, int]:
    _check_uri("checkpoint.uri", spec.checkpoint.uri)
    if spec.recipe.name == SCRIPT:
        return _check_script(spec)
    if offline and remote_data(spec) and spec.recipe.name != "digits-cnn":  # digits refuses any data.uri below
        return {}  # its size and vocabulary are read from the data: `run` checks them
    recipe = recipe_facts(spec)
    n_train = recipe.check_data()
    _check_model_size(spec, recipe)
    per_stage = {}
    for stage in TRAINING_STAGES:
        limits = getattr(spec.stages, stage)
        if limits.max_samples is not None and limits.max_samples > n_train:
            raise SpecError(
                f"stages.{stage}.max_samples = {limits.max_samples}: larger than the {n_train} "
                f"training samples of {recipe.data_uri()}; lower it or leave it unset"
            )
        n = limits.max_samples or n_train
        nodes, nproc = stage_world(spec, stage)
        world = nodes * nproc
        global_batch = spec.optim.batch_size * spec.optim.grad_accum * world
        if global_batch > n:
            raise SpecError(
                f"optim.batch_size = {spec.optim.batch_size}: the {stage} stage's global batch "
                f"{global_batch} (batch_size x grad_accum x {world} processes) exceeds its {n} "
                f"training samples; lower batch_size or raise stages.{stage}.max_samples"
            )
        per_stage[stage] = n
    if spec.stages.smoke.max_steps < 2:
        raise SpecError(
            f"stages.smoke.max_steps = {spec.stages.smoke.max_steps}: the smoke stage stops half way "
            "and resumes, so it needs at least 2 steps"
        )
    return per_stage


# What one training process holds per parameter: fp32 weights, gradients and AdamW's two moments.
BYTES_PER_PARAM = 16
# The most memory one accelerator has (B200: 192 GB); every process holds a full replica (DDP).
MAX_DEVICE_BYTES = 192 << 30


def _check_model_size(spec: RunSpec, recipe: RecipeFacts) -> None:
    """A model whose training state cannot fit where it runs fails minutes in with an out-of-memory kill."""

    gpu = spec.pool.gpus_per_node > 0
    room = MAX_DEVICE_BYTES if gpu else psutil.virtual_memory().total
    where = (
        "the largest accelerator"
        if gpu
        else f"this machine (for {spec.resources.procs_per_node} processes, each with a full copy)"
    )
    sizes = recipe.tensor_sizes()  # counted from the params: nothing is built or allocated, whatever the size
    if any(4 * size >= 2**63 for size in sizes):  # fp32: one tensor alone has more bytes than a 64-bit size holds
        raise SpecError(
            f"recipe.params = {_shown(spec.recipe.params)}: a layer of this model has more than 2^63 "
            f"bytes, beyond the {room / 2**30:.0f} GiB of memory of {where}; make the model smaller"
        )
    n = sum(sizes)
    per_node = BYTES_PER_PARAM * n * (1 if gpu else spec.resources.procs_per_node)
    if per_node > room:
        raise SpecError(
            f"recipe.params = {_shown(spec.recipe.params)}: the model has {n:.3g} parameters, "
            f"~{per_node / 2**30:.3g} GiB of weights, gradients and optimizer state, more than the "
            f"{room / 2**30:.0f} GiB of memory of {where}; make the model smaller"
        )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def stage_metrics(spec: RunSpec, stage: str) -> set[str]:
    """The metric names ``stage`` of this spec can report: what its gate rules may test."""
    if stage == "unit":
        return set(UNIT_METRICS)
    script = spec.recipe.script
    if script is None:
        return {*RUNTIME_METRICS, *PROFILE_METRICS, *SUPERVISED_METRICS, *EVAL_METRICS.get(spec.recipe.name, ())}
    # recipes.script.summarize: each named group, its first/min/max, and the loss trend.
    groups = {g for p in script.metrics for g in re.compile(p).groupindex} - {"step", TOTAL}
    out = {f"{g}{suffix}" for g in groups for suffix in ("", "_first", "_min", "_max")}
    if groups & {"loss", "train_loss"}:
        out.add("loss_decrease_fraction")
    return out | {"nonfinite_steps", "steps", *SUPERVISED_METRICS}


def _known(names: set[str]) -> str:
    text = ", ".join(sorted(names))
    return text if len(text) <= 500 else text[:497] + "..."


def _check_metrics(spec: RunSpec) -> None:
    """A gate rule on a metric its stage never reports fails every run; say so before any runs."""
    for stage in STAGES:
        can = stage_metrics(spec, stage)
        hint = (
            " (a script reports the named groups of recipe.script.metrics)"
            if spec.recipe.script and stage != "unit"
            else ""
        )
        for i, rule in enumerate(spec.gate(stage).rules):
            if rule.metric in can:
                continue
            if stage in spec.gates:
                raise SpecError(
                    f"gates.{stage}.rules.{i}.metric = {rule.metric!r}: the {stage} stage never reports "
                    f"it{hint}; use one of: {_known(can)}"
                )
            raise SpecError(
                f"gates.{stage} = (default) '{rule.metric} {rule.op} {rule.value:g}': the {stage} stage "
                f"never reports {rule.metric}{hint}, so its default gate cannot pass; set "
                f"gates.{stage}.rules on metrics it reports: {_known(can)}"
            )
    if spec.checkpoint.best_metric not in MANIFEST_METRICS:
        raise SpecError(
            f"checkpoint.best_metric = {spec.checkpoint.best_metric!r}: checkpoint manifests record only "
            f"{list(MANIFEST_METRICS)}, so keep_best could not rank by it; use one of those"
        )


def _check_sweep(spec: RunSpec) -> None:
    sw = spec.sweep
    assert sw is not None
    # lazy: Optuna takes seconds to import; only a spec with a sweep is checked against it
    from traingate.sweep.space import check_space

    check_space(spec)
    can = stage_metrics(spec, sw.stage) | set(TRIAL_METRICS)
    for i, o in enumerate(sw.objectives):
        if o.metric not in can:
            raise SpecError(
                f"sweep.objectives.{i}.metric = {o.metric!r}: a {sw.stage} trial never reports it; "
                f"use one of: {_known(can)}"
            )
    pruning = sw.scheduler.name in ("median", "asha", "hyperband")
    intermediate = set(EVAL_METRICS.get(spec.recipe.name, ()))
    if pruning and len(sw.objectives) == 1 and sw.objectives[0].metric not in intermediate:
        raise SpecError(
            f"sweep.scheduler.name = {sw.scheduler.name!r}: it prunes on the objective "
            f"{sw.objectives[0].metric!r}, which the intermediate validations do not report "
            f"({sorted(intermediate) or 'none, for this recipe'}), so it would never prune; "
            "use scheduler fifo or one of those objectives"
        )


def _resolved(field: str, uri: str) -> str:
    return resolve(uri, field=field)


def _scheme(uri: str) -> str:
    return uri.split("://", 1)[0].lower() if "://" in uri else ""


def _check_uri(field: str, uri: str | None, schemes: set[str] | None = None) -> None:
    """Syntax and an installed filesystem; ``schemes``: the ones allowed (default: a checkpoint store's)."""
    if uri is None:
        return
    shown = redact(uri)
    allowed = _SCHEMES if schemes is None else schemes
    scheme = _scheme(uri)
    if scheme == "memory":
        raise SpecError(
            f"{field} = {shown!r}: memory:// lives inside one process, and every stage runs in its "
            "own; use file:///abs/path or s3://bucket/prefix"
        )
    if scheme not in allowed:
        kinds = f"one of the schemes {sorted(allowed)}" if len(allowed) < 10 else "a scheme fsspec knows"
        raise SpecError(f"{field} = {shown!r}: needs a URI with {kinds}, e.g. file:///abs/path or s3://bucket/prefix")
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as e:
        raise SpecError(
            f"{field} = {shown!r}: no filesystem for {scheme}:// is installed ({e}); install it or use file:// or s3://"
        ) from None
    parts = urlsplit(_resolved(field, uri))
    if scheme == "file" and (parts.netloc not in ("", "localhost") or not parts.path.startswith("/")):
        raise SpecError(f"{field} = {shown!r}: a file URI needs an absolute path, file:///abs/path (three slashes)")
    bucket = parts.netloc.rpartition("@")[2]  # never echo credentials written into the URI
    if scheme == "s3" and not _S3_BUCKET.fullmatch(bucket):
        raise SpecError(
            f"{field} = {shown!r}: {bucket!r} is not a valid S3 bucket name (3-63 lowercase "
            "letters, digits, '.' or '-'); write s3://bucket/prefix"
        )


def _check_script(spec: RunSpec) -> dict[str, int]:
    s = spec.recipe.script
    assert s is not None  # guaranteed by RecipeSpec
    workdir = Path(s.workdir)
    if not workdir.is_dir():
        raise SpecError(f"recipe.script.workdir = {s.workdir!r}: not a directory; give the script's working directory")
    problem = place_problem(workdir)
    if problem:
        raise SpecError(f"recipe.script.workdir = {s.workdir!r}: {problem}")
    _check_project_size(s.workdir)
    exe = s.command[0]
    if exe not in ("python", "python3") and shutil.which(exe, path=None) is None and not (workdir / exe).exists():
        raise SpecError(f"recipe.script.command[0] = {exe!r}: not found on PATH or in the workdir; fix the command")
    if exe in ("python", "python3") and len(s.command) > 1 and not s.command[1].startswith("-"):
        if not (workdir / s.command[1]).is_file():
            raise SpecError(f"recipe.script.command[1] = {s.command[1]!r}: no such file in {s.workdir!r}")
    for t in s.tests:
        if not (workdir / t.split("::")[0]).exists():
            raise SpecError(f"recipe.script.tests: {t!r} does not exist in {s.workdir!r}; fix the path")
    if s.needs_cuda and spec.pool.gpus_per_node == 0:
        raise SpecError(
            f"recipe.script.needs_cuda = true: work pool {spec.resources.work_pool!r} is a CPU pool "
            "(gpus_per_node 0) and the script would fail there; set resources.work_pool to a GPU pool"
        )

    check_args(spec, SCRIPT_ARG_VARS)
    if s.checkpoints is not None:
        check_glob(s.checkpoints)
    if spec.data.uri:
        _check_uri("data.uri", spec.data.uri, _data_schemes())
        if _scheme(spec.data.uri) == "file":  # remote data is probed by preflight
            path = Path(urlsplit(_resolved("data.uri", spec.data.uri)).path)
            if not path.exists():
                raise SpecError(f"data.uri = {redact(spec.data.uri)!r}: does not exist; fix the location")
            check_local_data("data.uri", redact(spec.data.uri), path)
    return {}


# A script project outside git is versioned by hashing every file of its workdir, before each stage.
# Past these sizes the workdir is not a project (a home directory, a data disk) and hashing it would take
# minutes to hours; a real project this large keeps its data elsewhere or is a git checkout.
MAX_PROJECT_FILES = 20_000
MAX_PROJECT_BYTES = 2 << 30


def _check_project_size(workdir: str) -> None:
    try:
        inside_git = (
            subprocess.run(["git", "rev-parse", "HEAD"], cwd=workdir, capture_output=True, timeout=30).returncode == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        inside_git = False
    if inside_git:
        return
    state = Path(os.path.abspath(Settings.from_env().state_dir))
    files = size = 0
    for dirpath, dirnames, filenames in os.walk(workdir):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and here / d != state]
        for name in filenames:
            try:
                st = os.lstat(here / name)
            except OSError:
                continue
            kind = next((k for test, k in KINDS if test(st.st_mode)), None)
            if kind:
                raise SpecError(
                    f"recipe.script.workdir = {workdir!r}: holds {kind} at {str(here / name)!r}, and a "
                    "project outside git is versioned by reading every file; remove it or make the "
                    "project a git checkout"
                )
            files += 1
            size += st.st_size if stat.S_ISREG(st.st_mode) else 0
            if files > MAX_PROJECT_FILES or size > MAX_PROJECT_BYTES:
                raise SpecError(
                    f"recipe.script.workdir = {workdir!r}: is no git checkout and holds more than "
                    f"{MAX_PROJECT_FILES} files or {MAX_PROJECT_BYTES >> 30} GiB, all of which would be "
                    "hashed for its code version; point workdir at the project directory, keep data "
                    "elsewhere (data.uri) or make the project a git checkout"
                )


def _data_schemes() -> set[str]:
    # Data is only read, so any fsspec protocol that can be imported here will do.
    return set(fsspec.available_protocols()) - {"memory"}


# ---------------------------------------------------------------- preflight

_REACHED: set[tuple[str, Settings]] = set()


def preflight(spec: RunSpec, settings: Settings) -> None:
    """Can a run of ``spec`` reach everything it will use? Read-only probes, one SpecError line each.

    Once per spec, settings and process (the CLI probes before it starts the flow; the flow probes
    what a deployment hands it).

    Runs after :func:`check_spec` and before anything is created: no directory, database,
    bucket object or flow run exists because of it, whatever it finds.
    """
    key = (spec.spec_hash(), settings)
    if key in _REACHED:
        return
    _preflight(spec, settings)
    _REACHED.add(key)


def _preflight(spec: RunSpec, settings: Settings) -> None:
    if REF.search(str(settings.state_dir)):  # a plain path: a reference there would be a directory's name
        raise SpecError(
            f"TRAINGATE_STATE_DIR = {str(settings.state_dir)!r}: ${{env:NAME}} references are resolved in URIs, "
            "not in the state directory; write the path itself"
        )
    _creatable("TRAINGATE_STATE_DIR", str(settings.state_dir), settings.state_dir)
    _has_room("TRAINGATE_STATE_DIR", str(settings.state_dir), settings.state_dir)
    home = os.environ.get("PREFECT_HOME")
    if home and not os.environ.get("PREFECT_API_URL"):  # the temporary server keeps its database there
        _creatable("PREFECT_HOME", home, Path(home))
        _has_room("PREFECT_HOME", home, Path(home))
    if spec.checkpoint.uri:
        _store_writable("checkpoint.uri", spec.checkpoint.uri, settings)
    else:
        _check_uri("TRAINGATE_CHECKPOINT_URI", settings.checkpoint_uri)
        _store_writable("TRAINGATE_CHECKPOINT_URI", settings.checkpoint_uri, settings)
    if _scheme(settings.artifact_uri) in ("file", "s3"):
        _check_uri("TRAINGATE_ARTIFACT_URI", settings.artifact_uri)
        _store_writable("TRAINGATE_ARTIFACT_URI", settings.artifact_uri, settings)
    if spec.data.uri and spec.recipe.name != "digits-cnn":  # digits reads only its bundled data
        _readable("data.uri", spec.data.uri, settings)
    if settings.s3_endpoint_url and (why := url_problem(settings.s3_endpoint_url, {"http", "https"})):
        raise SpecError(f"{S3_ENDPOINT_VAR} = {redact(settings.s3_endpoint_url)!r}: {why}")
    _database_reachable("TRAINGATE_TRACKING_URI", settings.tracking_uri, tracking=True)
    if spec.sweep is not None:
        _database_reachable("TRAINGATE_OPTUNA_STORAGE", settings.optuna_storage, tracking=False)


def _creatable(field: str, shown: str, path: Path) -> None:
    """``path`` is a writable directory on a disk, or could be created: its nearest existing ancestor is one."""
    problem = place_problem(path)
    if problem:
        raise SpecError(f"{field} = {shown!r}: {problem}")
    here = path
    try:
        while not here.exists():
            if here.is_symlink():  # a dangling link: mkdir would fail on it
                raise SpecError(
                    f"{field} = {shown!r}: {str(here)!r} is a broken symbolic link; remove it or "
                    "choose another location"
                )
            here = here.parent
        if not here.is_dir():
            raise SpecError(
                f"{field} = {shown!r}: {str(here)!r} is {special_kind(here) or 'a file'}, so no directory can be "
                "created under it; choose another location"
            )
    except PermissionError:
        raise SpecError(
            f"{field} = {shown!r}: {str(here)!r} cannot be looked into (permission denied); "
            "choose a location this user can write"
        ) from None
    if not os.access(here, os.W_OK | os.X_OK):
        what = "is not writable" if here == path else f"(its nearest existing parent {str(here)!r}) is not writable"
        raise SpecError(f"{field} = {shown!r}: {what} by this user; fix the permissions or choose another location")


# The smallest ladder run (digits up to smoke) leaves 7.1 MiB in its state dir: Prefect's database 5.4,
# MLflow's 1.1, checkpoints and logs. With less free, a run started and broke part way in whichever
# database filled the disk first (3 MiB free: 1,583 lines and 21 tracebacks of Prefect's server).
MIN_FREE_BYTES = 64 << 20


def _has_room(field: str, shown: str, path: Path) -> None:
    """The filesystem ``path`` is (or will be created) on has MIN_FREE_BYTES free."""
    here = path
    while not here.exists() and here != here.parent:
        here = here.parent
    free = shutil.disk_usage(here).free
    if free < MIN_FREE_BYTES:
        raise SpecError(
            f"{field} = {shown!r}: only {free / 2**20:.1f} MiB free on the filesystem of {str(here)!r}; a run "
            f"needs at least {MIN_FREE_BYTES >> 20} MiB there (Prefect's and MLflow's databases, logs, "
            "checkpoints): free space there or choose a location on a larger disk"
        )


def _store_writable(field: str, uri: str, settings: Settings) -> None:
    shown = redact(uri)
    real = _resolved(field, uri)
    scheme = _scheme(real)
    if scheme == "file":
        _creatable(field, shown, Path(urlsplit(real).path))
        _has_room(field, shown, Path(urlsplit(real).path))
    elif scheme == "s3":
        _s3_probe(field, shown, real, settings, key_needed=False)
    else:
        _fsspec_probe(field, shown, real, bucket_only=True)


def _readable(field: str, uri: str, settings: Settings) -> None:
    shown = redact(uri)
    real = _resolved(field, uri)
    scheme = _scheme(real)
    if scheme == "file":
        path = Path(urlsplit(real).path)
        if not path.exists():
            raise SpecError(f"{field} = {shown!r}: does not exist; fix the location")
        check_local_data(field, shown, path)
        if not os.access(path, os.R_OK):
            raise SpecError(f"{field} = {shown!r}: not readable by this user; fix its permissions")
    elif scheme == "s3":
        _s3_probe(field, shown, real, settings, key_needed=True)
    else:
        _fsspec_probe(field, shown, real, bucket_only=False)


def _s3_client(settings: Settings) -> Any:
    # Fail fast: a probe that waits minutes on a dead endpoint is worse than the error.
    config = Config(connect_timeout=PROBE_TIMEOUT_S, read_timeout=PROBE_TIMEOUT_S, retries={"max_attempts": 1})
    # A new session reads the credentials as the environment has them now (boto3's default
    # session keeps what it found the first time).
    return boto3.session.Session().client("s3", endpoint_url=settings.s3_endpoint_url, config=config)


def _s3_probe(field: str, shown: str, uri: str, settings: Settings, key_needed: bool) -> None:
    """The bucket exists and these credentials may use it; for data, the object (or prefix) exists."""

    parts = urlsplit(uri)
    bucket, key = parts.netloc, parts.path.lstrip("/")
    where = f" at {settings.s3_endpoint_url}" if settings.s3_endpoint_url else ""
    try:
        client = _s3_client(settings)
        client.head_bucket(Bucket=bucket)
        if key_needed and key:
            try:
                client.head_object(Bucket=bucket, Key=key)
            except ClientError as e:
                if s3_code(e) not in ("404", "NoSuchKey", "NotFound"):
                    raise
                listed = client.list_objects_v2(Bucket=bucket, Prefix=key.rstrip("/") + "/", MaxKeys=1)
                if not listed.get("KeyCount"):
                    raise SpecError(
                        f"{field} = {shown!r}: no object {key!r} in bucket {bucket!r}{where}; "
                        "fix the location or upload the data"
                    ) from None
    except (NoCredentialsError, PartialCredentialsError):
        raise SpecError(
            f"{field} = {shown!r}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or an instance role)"
        ) from None
    except ClientError as e:
        code = s3_code(e)
        if code in ("404", "NoSuchBucket", "NotFound"):
            raise SpecError(
                f"{field} = {shown!r}: bucket {bucket!r} does not exist{where}; create it or fix the URI"
            ) from None
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled"):
            raise SpecError(
                f"{field} = {shown!r}: access to bucket {bucket!r}{where} is denied ({code}) with "
                "these credentials; fix the credentials or the bucket policy"
            ) from None
        raise SpecError(
            f"{field} = {shown!r}: S3{where} answered {code} for bucket {bucket!r}; fix the URI or the store"
        ) from None
    except BotoCoreError as e:  # endpoint unreachable, timeouts, malformed endpoint
        raise SpecError(
            f"{field} = {shown!r}: S3{where} cannot be reached ({type(e).__name__}); check "
            "TRAINGATE_S3_ENDPOINT_URL and the network"
        ) from None


def _fsspec_probe(field: str, shown: str, uri: str, bucket_only: bool) -> None:
    """Other installed filesystems (gs, az, http...): the location (or its bucket) exists."""
    try:
        fs, path = fsspec.core.url_to_fs(uri)
        target = path.split("/", 1)[0] if bucket_only else path
        found = fs.exists(target)
    except (OSError, ValueError, ImportError) as e:
        raise SpecError(
            f"{field} = {shown!r}: cannot be reached ({type(e).__name__}: "
            f"{redact(str(e)).splitlines()[0][:200] if str(e) else 'no detail'}); fix the URI or "
            "the credentials"
        ) from None
    if not found:
        raise SpecError(f"{field} = {shown!r}: does not exist; fix the location")


def _database_reachable(field: str, uri: str, tracking: bool) -> None:
    """A SQLite file that could be created, or a server that answers within a few seconds."""
    shown = redact(uri)
    real = _resolved(field, uri)
    scheme = _scheme(real).split("+", 1)[0]
    if scheme == "sqlite":
        path = real.split("://", 1)[1]
        if path in ("", "/", "/:memory:") or path.startswith("/:memory:"):
            raise SpecError(
                f"{field} = {shown!r}: an in-memory SQLite store is gone when its process ends and "
                "no stage process could share it; give a file, sqlite:////abs/path.db"
            )
        db = Path(path[1:] if path.startswith("/") else path)  # sqlite:///rel.db, sqlite:////abs.db
        if db.exists():
            if not db.is_file():
                raise SpecError(f"{field} = {shown!r}: {str(db)!r} is not a file; point it at a SQLite database file")
            if not os.access(db, os.R_OK | os.W_OK):
                raise SpecError(f"{field} = {shown!r}: {str(db)!r} is not writable by this user; fix its permissions")
        else:
            _creatable(field, shown, db.parent)
        _has_room(field, shown, db.parent)
    elif scheme in ("http", "https") and tracking:
        if why := url_problem(real, {"http", "https"}):
            raise SpecError(f"{field} = {shown!r}: {why}")
        _http_health(field, shown, real)
    elif scheme in ("postgresql", "postgres", "mysql"):
        _tcp_answers(field, shown, real, 5432 if scheme.startswith("postgres") else 3306)
    else:
        kinds = (
            "sqlite:////abs/path.db, http(s)://server or postgresql://..."
            if tracking
            else "sqlite:////abs/path.db or postgresql://..."
        )
        raise SpecError(f"{field} = {shown!r}: {scheme or 'no'} scheme is not a store traingate can use; use {kinds}")


def _http_health(field: str, shown: str, uri: str) -> None:
    try:
        urlsplit(uri).port  # noqa: B018 - raises for a port that is not 0-65535
    except ValueError:
        raise SpecError(f"{field} = {shown!r}: the port is not a number 0-65535; fix the URI") from None
    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as r:  # noqa: S310 - the URI is the user's setting
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    except (OSError, ValueError) as e:  # URLError is an OSError; a malformed host or port a ValueError
        reason = getattr(e, "reason", e)
        why = f"no answer within {PROBE_TIMEOUT_S:.0f} s" if isinstance(reason, TimeoutError) else str(reason)
        raise SpecError(
            f"{field} = {shown!r}: the MLflow server does not answer ({redact(why)}); start it or fix the URI"
        ) from None
    if status != 200:
        raise SpecError(
            f"{field} = {shown!r}: GET /health answered HTTP {status}, not 200; check that this is "
            "a running MLflow server"
        )


def _tcp_answers(field: str, shown: str, uri: str, default_port: int) -> None:
    parts = urlsplit(uri)
    if not parts.hostname:
        return  # a local socket: the driver finds it, nothing to dial
    try:
        port = parts.port or default_port
    except ValueError:
        raise SpecError(f"{field} = {shown!r}: the port is not a number 1-65535; fix the URI") from None
    try:
        with socket.create_connection((parts.hostname, port), timeout=PROBE_TIMEOUT_S):
            pass
    except OSError as e:
        why = "no answer in time" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__)
        raise SpecError(
            f"{field} = {shown!r}: nothing answers on {parts.hostname}:{port} ({why}); start the "
            "database or fix the URI"
        ) from None
