"""End-to-end resume drills: real training processes (python / torchrun with gloo), really killed.

All scenarios start together, on first use, in a few threads (each mostly waits on its
subprocesses), so the module costs about as long as its longest scenario; each test
then checks what its scenario left behind.

Scenarios (36 steps, a checkpoint every 4):
  d1  digits,  1 process,  file://  3 kills, one of them mid-save at tensor_write
  d2  digits,  2 processes, file:// 3 kills, one at before_manifest
  c1  char-gpt, 1 process, s3://    3 kills, one at upload; then SIGTERM
  c2  char-gpt, 2 processes, file:// 3 kills, one at after_manifest; then SIGTERM to rank 1;
      a copy of its state after the SIGTERM is resumed with 1 process (world size change)
  outage  char-gpt, 1 process, s3://, checkpoints by wall clock; the S3 endpoint is taken
      down for a few seconds mid-run
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from resume_drill import Drill, assert_state_equal, drive, write_spec
from traingate.recipes import get_recipe
from traingate.runtime import exitcodes
from traingate.runtime.sampler import ResumableSampler
from traingate.spec import parse_spec

pytestmark = pytest.mark.slow

MAX, EVERY = 36, 4
FILE_CKPT = f"checkpoint: {{every_steps: {EVERY}}}\n"


def _chain(root: Path, env: dict, name: str, recipe: str, nproc: int, phase: str, sigterm: str | int | None,
           checkpoint: str = FILE_CKPT, uri: str | None = None,
           pool: ThreadPoolExecutor | None = None) -> dict[str, Drill]:
    spec = write_spec(root / f"{name}.yaml", recipe, MAX, checkpoint)
    ref = Drill(f"{name}-ref", spec, nproc, root, env=env)
    ref.run("reference")
    chain = Drill(name, spec, nproc, root, checkpoint_uri=uri, env=env)
    drive(chain, EVERY, MAX, [phase], seed=name, sigterm_rank=sigterm)
    out = {"ref": ref, "chain": chain}
    if name == "c2":
        # The state right after the SIGTERM, resumed by a world of 1 instead of 2 (alongside).
        # Same run id ("c2"): a checkpoint of another run is refused (traingate/runtime/checkpoint.py).
        shutil.copytree(chain.out, root / "ws" / "c2")
        ws = Drill("c2", spec, 1, root / "ws", env=env)
        out["ws"] = ws
        out["ws_done"] = pool.submit(ws.run, "final")
    chain.run("final")
    return out


def _outage(root: Path, env: dict, moto) -> dict:
    spec = write_spec(root / "outage.yaml", "chargpt", 80,
                      "checkpoint: {every_steps: null, every_minutes: 0.0005, keep_last: 100}\n")
    drill = Drill("outage", spec, 1, root, checkpoint_uri="s3://tg-test/drills/outage/full", env=env)
    start = drill.latest()[0]
    proc, tree = drill._launch_stopped_at(5)
    assert tree is not None, drill._stderr()[-3000:]
    moto.stop()
    t_down = time.monotonic()
    drill._signal(tree, signal.SIGCONT)
    time.sleep(4.0)
    moto.start()
    down_s = time.monotonic() - t_down
    rc = drill._wait(proc)
    rec = drill._record("final", rc, start)
    return {"drill": drill, "rec": rec, "down_s": down_s}


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def _refused(root: Path, env: dict) -> dict:
    """A run whose newest checkpoint was forged with a pickle payload (and a manifest that checks out)."""
    spec = write_spec(root / "refused.yaml", "chargpt", 8, FILE_CKPT)
    drill = Drill("refused", spec, 1, root, env=env)
    marker = root / "pwned"
    step = drill.out / "checkpoints" / "step_00000012"
    step.mkdir(parents=True)
    torch.save({"w": torch.ones(1), "x": _Payload(str(marker))}, step / "model.pt")
    data = (step / "model.pt").read_bytes()
    (step / "manifest.json").write_text(json.dumps({"format": 1, "step": 12, "files": {
        "model.pt": {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}}}))
    proc = drill._launch()
    rc = drill._wait(proc)
    return {"rc": rc, "marker": marker, "stderr": drill._stderr(),
            "last_words": json.loads((drill.out / "last_words.rank0.json").read_text())}


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory, s3_endpoint) -> dict[str, Future]:
    root = tmp_path_factory.mktemp("drills")
    env = dict(os.environ)
    pool = ThreadPoolExecutor(max_workers=5, thread_name_prefix="drill")

    def c1_then_outage() -> dict:
        c1 = _chain(root, env, "c1", "chargpt", 1, "upload", None, uri="s3://tg-test/drills/c1/full")
        # The outage takes the shared endpoint down, so it runs only after c1 is done with it.
        return {**c1, "outage": _outage(root, env, s3_endpoint)}

    futures = {  # longest first
        "c2": pool.submit(_chain, root, env, "c2", "chargpt", 2, "after_manifest", 1, pool=pool),
        "d2": pool.submit(_chain, root, env, "d2", "digits", 2, "before_manifest", "none"),
        "c1": pool.submit(c1_then_outage),
        "d1": pool.submit(_chain, root, env, "d1", "digits", 1, "tensor_write", "none",
                          f"checkpoint: {{every_steps: {EVERY}, keep_last: 2, keep_every: 12, keep_best: 1}}\n"),
        "refused": pool.submit(_refused, root, env),
    }
    yield futures
    pool.shutdown(wait=True)
    for name, fut in futures.items():
        if fut.done() and fut.exception() is None:
            for key, d in fut.result().items() if name != "refused" else ():
                if isinstance(d, Drill):
                    print(f"{d.name}: " + ", ".join(f"{h.kind} {h.seconds:.1f}s" for h in d.history))


def _assert_bitwise_resume(runs: dict[str, Drill]) -> None:
    ref, chain = runs["ref"], runs["chain"]
    kinds = [h.kind for h in chain.history]
    kills = [h for h in chain.history if h.kind == "kill" or h.kind.startswith("fault:")]
    assert len(kills) == 3 and any(h.kind.startswith("fault:") for h in kills), kinds
    assert len({h.target for h in kills}) == 3, f"kill steps not distinct: {[h.target for h in kills]}"
    for h in kills:
        assert h.returncode != 0 and h.result is None, f"{h.kind} at {h.target} was not an interruption"
    assert chain.history[-1].kind == "final" and chain.result()["status"] == "completed"
    assert chain.result()["resumed_from_step"] > 0
    assert_state_equal(ref.state(MAX), chain.state(MAX))
    # What the stage's gate reads is the uninterrupted stage's too: the checkpoints carry its loss curve's ends.
    summary = ("first_loss", "final_loss", "loss_decrease_fraction", "nonfinite_steps", "max_grad_norm")
    assert {k: chain.result()["metrics"][k] for k in summary} == {k: ref.result()["metrics"][k] for k in summary}
    ref_samples, chain_samples = ref.samples(), chain.samples()
    assert sorted(chain_samples[0]) == list(range(1, MAX + 1))
    assert chain_samples == ref_samples, "the resumed run consumed a different sequence of sample ids"


def test_digits_one_process_killed_three_times_resumes_to_bitwise_identical_weights_and_samples(scenarios):
    _assert_bitwise_resume(scenarios["d1"].result())


def test_digits_two_processes_killed_three_times_resume_to_bitwise_identical_weights_and_samples(scenarios):
    _assert_bitwise_resume(scenarios["d2"].result())


def test_chargpt_two_processes_killed_three_times_resume_to_bitwise_identical_weights_and_samples(scenarios):
    _assert_bitwise_resume(scenarios["c2"].result())


def test_chargpt_one_process_with_checkpoints_on_s3_killed_three_times_resumes_bitwise(scenarios):
    runs = scenarios["c1"].result()
    assert runs["chain"].checkpoint_uri.startswith("s3://")
    _assert_bitwise_resume(runs)


def test_kill_at_each_save_phase_leaves_the_previous_checkpoint_as_a_loadable_latest(scenarios):
    seen = {}
    for name in ("d1", "d2", "c1", "c2"):
        for h in scenarios[name].result()["chain"].history:
            if not h.kind.startswith("fault:"):
                continue
            phase = h.kind.removeprefix("fault:")
            seen[phase] = name
            assert h.returncode != 0 and h.result is None, f"{name}: the {phase} fault did not kill the run"
            assert h.latest_loads
            if phase == "after_manifest":
                # The manifest made it: the checkpoint exists and is the latest.
                assert h.latest == h.target, (name, phase, h.latest, h.target)
            else:
                previous = h.target - EVERY or None
                assert h.target not in h.complete_steps, f"{name}: torn save of step {h.target} looks complete"
                assert h.latest == previous, (name, phase, h.latest, previous)
    assert seen.keys() == {"tensor_write", "before_manifest", "upload", "after_manifest"}, seen


def test_sigterm_to_one_rank_stops_both_ranks_at_one_step_with_an_emergency_checkpoint_and_exit_75(scenarios):
    runs = scenarios["c2"].result()
    term = next(h for h in runs["chain"].history if h.kind == "sigterm")
    stopped = term.heartbeats[0]
    assert term.heartbeats == {0: stopped, 1: stopped}, f"ranks stopped at different steps: {term.heartbeats}"
    assert term.result["status"] == "preempted" and term.result["exit_code"] == exitcodes.PREEMPTED
    assert term.result["steps_done"] == stopped
    assert term.latest == stopped and term.latest_manifest["emergency"] is True
    # torchrun reports each worker's exit code; both workers exited "preempted".
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", term.stderr)]
    assert codes and set(codes) == {exitcodes.PREEMPTED}, term.stderr[-3000:]
    # ...and the run resumed from exactly there (bitwise, see the c2 test above).
    assert runs["chain"].result()["resumed_from_step"] == stopped


def test_sigterm_single_process_flushes_the_emergency_checkpoint_to_s3_and_exits_75(scenarios):
    runs = scenarios["c1"].result()
    term = next(h for h in runs["chain"].history if h.kind == "sigterm")
    assert term.returncode == exitcodes.PREEMPTED
    assert term.result["status"] == "preempted"
    assert term.latest == term.heartbeats[0] and term.latest_manifest["emergency"] is True
    assert runs["chain"].result()["resumed_from_step"] == term.latest


def test_resume_with_a_different_world_size_neither_skips_nor_repeats_a_sample(scenarios):
    runs = scenarios["c2"].result()
    term = next(h for h in runs["chain"].history if h.kind == "sigterm")
    ws = runs["ws"]
    runs["ws_done"].result()
    assert ws.result()["resumed_from_step"] == term.latest and ws.result()["metrics"]["world_size"] == 1
    samples = ws.samples()  # the copied 2-process records, then the 1-process run's own
    rank1 = runs["chain"].samples()[1]
    sequence: list[int] = []
    for step in range(1, MAX + 1):
        sequence += samples[0][step]
        if step <= term.latest:
            sequence += rank1[step]  # rank r holds slice r of the global batch
    spec = parse_spec(yaml.safe_load(ws.spec.read_text()))
    n = len(get_recipe(spec).load_data()[0])
    sampler = ResumableSampler(n, 1, spec.optim.seed)
    largest_batch = 2 * spec.optim.batch_size
    pos, epoch = 0, 0
    while pos < len(sequence):
        perm = sampler.permutation(epoch)
        k = 0
        while pos + k < len(sequence) and k < n and sequence[pos + k] == perm[k]:
            k += 1
        assert pos + k == len(sequence) or n - k < largest_batch, \
            f"epoch {epoch}: the sequence leaves the permutation at position {k} of {n} (skip or repeat)"
        pos, epoch = pos + k, epoch + 1
    assert epoch >= 2  # the drill crossed an epoch boundary


def test_retention_keeps_every_mth_and_best_and_last_checkpoints_with_metrics_in_the_manifest(scenarios):
    chain = scenarios["d1"].result()["chain"]
    ck = chain.checkpointer()
    steps = ck.list_steps()
    assert {12, 24, 32, 36} <= set(steps), steps
    assert len(set(steps) - {12, 24, 32, 36}) <= 1, f"more than one best-by-metric extra: {steps}"
    assert all(isinstance(ck.manifest(s)["metrics"]["train_loss"], float) for s in steps)


def test_s3_outage_during_training_is_retried_with_backoff_and_training_completes(scenarios):
    out = scenarios["c1"].result()["outage"]
    rec, drill = out["rec"], out["drill"]
    assert out["down_s"] >= 4.0
    assert rec.returncode == 0 and rec.result["status"] == "completed", rec.stderr[-3000:]
    assert rec.result["steps_done"] == 80
    assert re.search(r"storage: .* failed \(EndpointConnectionError.*retry 1/", rec.stderr), rec.stderr[-3000:]
    assert "testing-secret-key-do-not-log" not in rec.stderr
    assert rec.latest == 80 and rec.latest_loads
    # No every_steps: the checkpoints before the final one were taken by the wall clock.
    assert len([s for s in rec.complete_steps if s < 80]) >= 2, rec.complete_steps


def test_a_run_whose_newest_checkpoint_carries_a_pickle_payload_refuses_it_without_running_it(scenarios):
    out = scenarios["refused"].result()
    assert not out["marker"].exists(), "the pickle payload ran inside the training process"
    assert out["rc"] == exitcodes.USER_ERROR  # not retryable: a restart would meet the same file
    assert "refused" in out["last_words"]["error"] and "weights-only allowlist" in out["last_words"]["error"]
