"""Job traces: the CSV format, its reader (one-line errors), its writer, and a generator.

Format: CSV in UTF-8 with a header, separated by commas, semicolons or tabs (the one that splits
the header into trace columns). Required columns ``job_id,submit_s,duration_s,gpus``; optional
``team,priority,est_duration_s`` and one of ``pool`` (one pool), ``pools`` (the pools a job accepts,
separated by ``|``) or ``gpu_types`` (the GPU models it accepts, separated by ``|``: every pool whose
``gpu`` is one of them). ``gpus`` is whole GPUs or a fraction of one GPU (``0.25``), which the
replay and the fill experiment pack onto a shared GPU (:mod:`traingate.capacity.shared`). A missing
``team`` column means team ``default``; a missing ``priority`` the config's ``default_class``; no
pool column the pool passed as ``default_pool`` (needed only when the config has several).
``est_duration_s`` is the submitter's prediction; when it is absent the simulator predicts from the trace's history
(:mod:`traingate.capacity.estimate`).

The generator (:func:`generate`) draws a trace shaped by two published characterisations:

- Weng et al., "MLaaS in the Wild: Workload Analysis and Scheduling in Large-Scale Heterogeneous
  GPU Clusters", NSDI'22 (two months of Alibaba PAI, ~6,700 GPUs): most jobs ask for a fraction
  of a GPU or one GPU; distributed jobs need gang scheduling; about 65% of jobs recur (the same
  job submitted again and again). Here: ``small_sizes`` puts 70% of jobs at 1 GPU (by default no
  fractions; sizes below 1 draw shared-GPU requests); ``recurring_fraction`` 0.65 of jobs are repeats of a
  ``templates`` set (same team, class, size; duration within ``recur_jitter`` of the template's).
- Hu et al., "Characterization of Large Language Model Development in the Datacenter", NSDI'24
  (Shanghai AI Lab's Acme): a heavy tail, about 3.2% of jobs (pretraining) take about 94% of the
  GPU time. Here: ``large_fraction`` 0.032 of jobs are gang jobs of ``large_sizes`` (whole nodes,
  a quarter or half of the pool), and their durations are scaled so that they hold exactly
  ``large_gpu_time_share`` 0.94 of the GPU time.

Everything else (duration medians and spreads, the team and class mix, Poisson arrivals at a
target ``load``) is our choice, stated in ``TraceParams``; it is not taken from the papers.
"""

from __future__ import annotations

import codecs
import csv
import dataclasses
import io
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from traingate.capacity.fill import to_milli
from traingate.capacity.jobs import Job
from traingate.capacity.policy import never_fits
from traingate.capacity.pools import CapacityConfig, CapacityError
from traingate.capacity.simulate import TraceJob

REQUIRED = ("job_id", "submit_s", "duration_s", "gpus")
OPTIONAL = ("team", "priority", "pool", "est_duration_s", "pools", "gpu_types")
# The columns that say where a job may run: one pool; pools separated by |; GPU models separated by |
# (each the `gpu` of one or more pools in the config, as a real trace's GPU-type column names them).
WHERE = ("pool", "pools", "gpu_types")
DEFAULT_TEAM = "default"
# Bounds past which a value is a unit or column mix-up, not a job: submissions up to ~317 years
# (Unix-epoch seconds pass, epoch milliseconds do not), runs and estimates up to a year, and
# no more GPUs than a few of the largest clusters together.
MAX_SUBMIT_S = 1e10
MAX_DURATION_S = 366 * 86400.0
MAX_GPUS = 1_000_000


def read_trace(path: str | Path, config: CapacityConfig, default_pool: str | None = None) -> list[TraceJob]:
    """Read and check a trace against the config; the first problem is one ``CapacityError`` line
    naming the file, line, column, value and fix. ``gpus`` may be a fraction of one GPU (the replay
    and the fill experiment pack such requests onto shared GPUs).

    The file is UTF-8 (a UTF-8 byte-order mark is skipped); the delimiter is the one of comma,
    semicolon or tab that splits the header into trace columns.
    """
    p = Path(path)
    if not p.exists():
        raise CapacityError(f"trace {str(path)!r} does not exist; pass a CSV with columns {','.join(REQUIRED)}")
    if not p.is_file():
        raise CapacityError(f"trace {str(path)!r} is not a file; pass a CSV with columns {','.join(REQUIRED)}")
    if default_pool is not None and default_pool not in config.pools:
        raise CapacityError(f"--pool {default_pool!r} is not in the pools config; use one of {sorted(config.pools)}")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise CapacityError(f"trace {str(path)!r} cannot be read ({e.strerror or e}); check its permissions") from None
    text = _decode(path, data)
    first = re.split(r"\r\n|\r|\n", text, maxsplit=1)[0]
    if not text.strip():
        raise CapacityError(f"{path}: empty file; the first line is the header {','.join(REQUIRED)}")
    if not first.strip():
        raise CapacityError(f"{path} line 1: blank; the first line is the header {','.join(REQUIRED)}")
    delimiter = _delimiter(path, first)
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)
    try:
        header = [h.strip() for h in next(reader)]
        _check_header(path, header)
        pool_fallback = default_pool
        if not set(WHERE) & set(header) and pool_fallback is None:
            if len(config.pools) != 1:
                raise CapacityError(
                    f"{path}: no `pool` column and the config has pools {sorted(config.pools)}; "
                    f"pass --pool NAME or add a pool column"
                )
            pool_fallback = next(iter(config.pools))
        jobs: list[TraceJob] = []
        seen: set[str] = set()
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(header):
                raise CapacityError(_width(path, line, row, header, delimiter))
            cells = dict(zip(header, (c.strip() for c in row)))
            jobs.append(_row(path, line, cells, config, pool_fallback, seen))
    except csv.Error as e:
        raise CapacityError(
            f"{path} line {reader.line_num}: not CSV ({e}); quote fields that hold the delimiter or a line break"
        ) from None
    if not jobs:
        raise CapacityError(f"{path}: no jobs after the header; add rows")
    return jobs


_DELIMITERS = {",": "commas", ";": "semicolons", "\t": "tabs"}
_BOMS = {
    codecs.BOM_UTF32_LE: "UTF-32",  # before UTF-16: its BOM starts with UTF-16 LE's
    codecs.BOM_UTF32_BE: "UTF-32",
    codecs.BOM_UTF16_LE: "UTF-16",
    codecs.BOM_UTF16_BE: "UTF-16",
}


def _decode(path: str | Path, data: bytes) -> str:
    for bom, name in _BOMS.items():
        if data.startswith(bom):
            raise CapacityError(
                f"{path} line 1: the file is {name} (it starts with a {name} byte-order mark); save it as UTF-8"
            )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        offset = e.start + (len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0)  # e: after the BOM
        line_start = data.rfind(b"\n", 0, offset) + 1
        line = data.count(b"\n", 0, offset) + 1
        head = data.split(b"\n", 1)[0].decode("utf-8-sig", errors="replace").strip("\r")
        before = data[line_start:offset].decode("utf-8", errors="replace")
        delimiter = next((d for d in _DELIMITERS if len(head.split(d)) > len(head.split(","))), ",")
        names = [h.strip() for h in head.split(delimiter)]
        index = before.count(delimiter)
        column = names[index] if index < len(names) and line > 1 else f"field {index + 1}"
        raise CapacityError(
            f"{path} line {line}: {column}: byte {data[offset : offset + 1]!r} is not UTF-8 (text in another "
            f"encoding, e.g. Latin-1 or Windows-1252); save the file as UTF-8"
        ) from None


def _delimiter(path: str | Path, header_line: str) -> str:
    """The delimiter that splits the header into the most trace columns."""
    known = set(REQUIRED + OPTIONAL)
    best = max(_DELIMITERS, key=lambda d: (sum(h.strip() in known for h in header_line.split(d)), d == ","))
    if sum(h.strip() in known for h in header_line.split(best)) == 0:
        raise CapacityError(
            f"{path} line 1: the header {header_line[:80]!r} names no trace column; the first line is the header "
            f"{','.join(REQUIRED)} (separated by commas, semicolons or tabs)"
        )
    return best


def _check_header(path: str | Path, header: list[str]) -> None:
    for k, c in enumerate(header):
        if not c:
            raise CapacityError(
                f"{path} line 1: column {k + 1} has no name (a trailing delimiter?); remove it or name it one of "
                f"{','.join(REQUIRED + OPTIONAL)}"
            )
        if c not in REQUIRED + OPTIONAL:
            raise CapacityError(
                f"{path} line 1: column {c!r} is not a trace column; remove it or use {','.join(REQUIRED + OPTIONAL)}"
            )
        if header.count(c) > 1:
            raise CapacityError(f"{path} line 1: column {c!r} appears twice; keep one")
    where = [c for c in WHERE if c in header]
    if len(where) > 1:
        raise CapacityError(
            f"{path} line 1: columns {where[0]!r} and {where[1]!r} both say where a job runs; keep one "
            f"(pool: one pool; pools: pools separated by |; gpu_types: GPU models separated by |)"
        )
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise CapacityError(
            f"{path} line 1: column {missing[0]!r} is missing; the header needs "
            f"{','.join(REQUIRED)} (optional: {','.join(OPTIONAL)})"
        )


def _width(path: str | Path, line: int, row: list[str], header: list[str], delimiter: str) -> str:
    """The one line for a row with too few or too many fields."""
    where = f"{path} line {line}: {len(row)} field{'s' if len(row) != 1 else ''}, the header has {len(header)}"
    other = next((d for d in _DELIMITERS if d != delimiter and any(d in c for c in row)), None)
    if other is not None and len(row) < len(header):
        return (
            f"{where}: this line is separated by {_DELIMITERS[other]}, the header by {_DELIMITERS[delimiter]}; "
            f"use one delimiter throughout"
        )
    if len(row) < len(header):
        return f"{where}: column {header[len(row)]!r} is missing; fill in {','.join(header[len(row) :])}"
    return (
        f"{where}: field {len(header) + 1} ({row[len(header)].strip()[:40]!r}) has no column; remove it "
        f"or quote a value that holds a {_DELIMITERS[delimiter][:-1]}"
    )


def _row(
    path: str | Path,
    line: int,
    cells: dict[str, str],
    config: CapacityConfig,
    pool_fallback: str | None,
    seen: set[str],
) -> TraceJob:
    def bad(col: str, why: str) -> CapacityError:
        return CapacityError(f"{path} line {line}: {col} = {cells.get(col, '')!r}: {why}")

    def number(col: str, positive: bool, most: float) -> float:
        try:
            v = float(cells[col])
        except ValueError:
            raise bad(col, "not a number; write seconds like 3600 or 12.5") from None
        if not math.isfinite(v):
            raise bad(col, "not a finite number; write seconds like 3600 or 12.5")
        if v < 0 or (positive and v == 0):
            raise bad(col, f"must be {'> 0' if positive else '>= 0'} (seconds)")
        if v > most:
            raise bad(col, f"over {most:,.0f} s, not a plausible trace time; is it in milliseconds? divide by 1000")
        return v

    def name(col: str, fallback: str) -> str:
        if col not in cells:
            return fallback
        if not cells[col]:
            raise bad(col, "empty; fill it in or drop the column")
        return cells[col]

    job_id = cells["job_id"]
    if not job_id:
        raise bad("job_id", "empty; every job needs an id")
    if job_id in seen:
        raise bad("job_id", "appears twice; job ids are unique")
    seen.add(job_id)
    submit = number("submit_s", positive=False, most=MAX_SUBMIT_S)
    duration = number("duration_s", positive=True, most=MAX_DURATION_S)
    try:
        gpus_f = float(cells["gpus"])
    except ValueError:
        raise bad("gpus", "not a number; write whole GPUs like 1, 8 or 16") from None
    if not math.isfinite(gpus_f) or gpus_f > MAX_GPUS:
        raise bad("gpus", f"not a plausible GPU count (at most {MAX_GPUS:,}); write whole GPUs like 1, 8 or 16")
    if gpus_f > 1 and not gpus_f.is_integer():
        raise bad(
            "gpus",
            f"a request above one GPU is whole GPUs (a fraction below 1 shares a GPU); round up to {math.ceil(gpus_f)}",
        )
    if not gpus_f > 0:
        raise bad("gpus", "must be > 0: a fraction of one GPU like 0.25, or whole GPUs like 1 or 8")
    est: float | None = None
    if cells.get("est_duration_s"):
        est = number("est_duration_s", positive=True, most=MAX_DURATION_S)
    priority = name("priority", config.default_class)
    if priority not in config.priority_classes:
        raise bad("priority", f"not a priority class; use one of {sorted(config.priority_classes)}")
    pools = _pools(cells, config, bad) or (name("pool", pool_fallback or ""),)
    pool = pools[0]
    if pool not in config.pools:
        raise bad("pool", f"not in the pools config; use one of {sorted(config.pools)} or add it there")
    job = Job(
        job_id,
        team=name("team", DEFAULT_TEAM),
        priority=priority,
        pool=pool,
        slots=math.ceil(gpus_f),
        submit_s=submit,
        est_duration_s=est,
        checkpoint_every_s=config.simulator.checkpoint_every_s,
        milli=0 if gpus_f.is_integer() else to_milli(gpus_f),
    )
    for p in pools:
        why = never_fits(dataclasses.replace(job, pool=p), config.pools, config.priority_classes, config.quotas)
        if why:
            raise bad("gpus", why)
    return TraceJob(job, duration, pools if len(pools) > 1 else (), None if gpus_f.is_integer() else gpus_f)


def _pools(cells: dict[str, str], config: CapacityConfig, bad: Callable[[str, str], CapacityError]) -> tuple[str, ...]:
    """The pools a ``pools`` or ``gpu_types`` cell accepts, in its order (a GPU model: every pool of
    that model, by name); () when the trace has neither column."""
    col = next((c for c in ("pools", "gpu_types") if c in cells), None)
    if col is None:
        return ()
    names = [n.strip() for n in cells[col].split("|")]
    if not all(names):
        raise bad(col, "an empty entry; list them separated by |, e.g. a100|h100")
    if col == "pools":
        for n in names:
            if n not in config.pools:
                raise bad(col, f"{n!r} is not in the pools config; use some of {sorted(config.pools)}")
        return tuple(dict.fromkeys(names))
    models = sorted({p.gpu for p in config.pools.values() if p.gpu})
    out: list[str] = []
    for n in names:
        mine = sorted(p for p, c in config.pools.items() if c.gpu == n)
        if not mine:
            raise bad(col, f"no pool has GPU {n!r}; the pools' GPUs are {models}, or add a pool with gpu: {n}")
        out += mine
    return tuple(dict.fromkeys(out))


def write_trace(path: str | Path, rows: list[dict[str, object]]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    cols = [c for c in REQUIRED + OPTIONAL if any(c in r for r in rows)]
    with p.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    return p


@dataclass(frozen=True)
class TraceParams:
    n_jobs: int = 10_000
    capacity: int = 64  # GPUs of the pool the trace is sized for
    gpus_per_node: int = 8
    load: float = 0.9  # offered GPU-time / (capacity x span of submissions)
    large_fraction: float = 0.032  # Hu et al. NSDI'24
    large_gpu_time_share: float = 0.94  # Hu et al. NSDI'24
    # Gang sizes of large jobs (whole nodes). None: a quarter (60%) and half (40%) of the pool's
    # nodes, 16 and 32 GPUs on 8 x 8; at most half the pool, so one job never drains it.
    large_sizes: tuple[tuple[int, float], ...] | None = None
    small_sizes: tuple[tuple[float, float], ...] = ((1, 0.70), (2, 0.12), (4, 0.10), (8, 0.08))  # Weng et al.
    small_median_s: float = 900.0  # lognormal durations (our choice)
    small_sigma: float = 1.4
    large_median_s: float = 8 * 3600.0  # before scaling to large_gpu_time_share
    large_sigma: float = 0.8
    recurring_fraction: float = 0.65  # Weng et al. NSDI'22
    templates: int = 150  # distinct recurring jobs (our choice)
    recur_jitter: float = 0.1  # sigma of a recurrence's log-duration around its template's
    teams: tuple[tuple[str, float], ...] = (("vision", 0.4), ("language", 0.3), ("speech", 0.2), ("recsys", 0.1))
    classes: tuple[tuple[str, float], ...] = (("urgent", 0.05), ("production", 0.30), ("research", 0.65))
    seed: int = 0


def generate(params: TraceParams = TraceParams()) -> list[dict[str, Any]]:
    """Trace rows (``job_id,submit_s,duration_s,gpus,team,priority``; no estimates: the simulator
    must predict from history). Deterministic for a given ``params``. Urgent jobs are small:
    large (pretraining-like) jobs are production or research."""
    return [{k: v for k, v in row.items() if k in REQUIRED + OPTIONAL} for row in generate_jobs(params)]


def generate_jobs(params: TraceParams) -> list[dict[str, Any]]:
    """:func:`generate`'s rows plus how each was drawn: ``large`` and ``template`` (the index of
    the recurring job it repeats, or None)."""
    rng = np.random.default_rng(params.seed)
    n = params.n_jobs
    gpn = params.gpus_per_node
    nodes = params.capacity // gpn
    large_sizes = params.large_sizes or ((max(1, nodes // 4) * gpn, 0.6), (max(1, nodes // 2) * gpn, 0.4))
    small_sizes = tuple((g, w) for g, w in params.small_sizes if g <= gpn)
    if not small_sizes:
        raise CapacityError(f"trace generator: no small_sizes fit a {gpn}-GPU node; add sizes <= {gpn}")

    def pick(choices: tuple[tuple[object, float], ...], size: int | None = None):
        vals = [c[0] for c in choices]
        w = np.array([c[1] for c in choices], dtype=float)
        idx = rng.choice(len(vals), size=size, p=w / w.sum())
        return [vals[i] for i in np.atleast_1d(idx)]

    def draw(large: bool) -> dict[str, Any]:
        if large:
            cls = pick((("production", 0.5), ("research", 0.5)))[0]
            gpus = pick(large_sizes)[0]
            dur = rng.lognormal(math.log(params.large_median_s), params.large_sigma)
        else:
            cls = pick(params.classes)[0]
            gpus = pick(small_sizes)[0]
            dur = rng.lognormal(math.log(params.small_median_s), params.small_sigma)
        return {"team": pick(params.teams)[0], "priority": cls, "gpus": gpus, "duration_s": dur, "large": large}

    n_large = round(n * params.large_fraction)
    large = np.zeros(n, dtype=bool)
    large[rng.choice(n, size=n_large, replace=False)] = True
    n_tl = max(1, round(params.templates * params.large_fraction * 3))  # a few recurring pretraining jobs
    templates = [draw(True) for _ in range(n_tl)] + [draw(False) for _ in range(params.templates - n_tl)]
    jobs: list[dict[str, Any]] = []
    for k in range(n):
        if rng.random() < params.recurring_fraction:
            ti = int(rng.integers(n_tl)) if large[k] else n_tl + int(rng.integers(params.templates - n_tl))
            t = templates[ti]
            j = {**t, "duration_s": t["duration_s"] * rng.lognormal(0.0, params.recur_jitter), "template": ti}
        else:
            j = {**draw(bool(large[k])), "template": None}
        jobs.append(j)
    fp = [j["gpus"] if j["gpus"] <= gpn else -(-j["gpus"] // gpn) * gpn for j in jobs]
    gt_large = sum(f * j["duration_s"] for f, j in zip(fp, jobs) if j["large"])
    gt_small = sum(f * j["duration_s"] for f, j in zip(fp, jobs) if not j["large"])
    if gt_large > 0 and gt_small > 0:
        s = params.large_gpu_time_share
        scale = s / (1 - s) * gt_small / gt_large
        for j in jobs:
            if j["large"]:
                j["duration_s"] *= scale
    gpu_time = sum(f * j["duration_s"] for f, j in zip(fp, jobs))
    span = gpu_time / (params.load * params.capacity)
    submits = np.cumsum(rng.exponential(span / n, size=n))
    submits -= submits[0]
    return [
        {
            "job_id": f"j{k:05d}",
            "submit_s": round(float(submits[k]), 1),
            "duration_s": round(max(float(j["duration_s"]), 1.0), 1),
            "gpus": j["gpus"],
            "team": j["team"],
            "priority": j["priority"],
            "large": j["large"],
            "template": j["template"],
        }
        for k, j in enumerate(jobs)
    ]
