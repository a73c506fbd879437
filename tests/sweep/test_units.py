"""Sweep building blocks without Prefect: spec checks, real in-process training, PBT checkpoint copy, fencing."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import optuna
import psutil
import pytest

from tgtest import TINY_DIGITS
from traingate.spec import SpecError, load_spec, load_spec_text

SPACE = "sweep: {space: {optim.lr: {type: float, low: 0.001, high: 0.1, log: true}}%s}\n"


@pytest.mark.parametrize("sweep, complaint", [
    ("sweep: {sampler: grid, space: {optim.lr: {type: float, low: 0.001, high: 0.1}}}", "grid"),
    ("sweep: {space: {x: {type: float, low: 0, high: 1}}, scheduler: {name: asha}, "
     "objectives: [{metric: val_loss, direction: minimize}, {metric: cost_usd, direction: minimize}]}", "multi-objective"),
    ("sweep: {space: {a: {type: int, low: 0, high: 3, when: {b: 1}}, b: {type: int, low: 0, high: 2}}}", "earlier"),
    ("sweep: {space: {optim.lr: {type: float, low: 0, high: 0.1, log: true}}}", "log scale"),
    ("sweep: {space: {optim.schedule: {type: categorical}}}", "choices"),
    ("sweep: {space: {}}", "space"),
    ("sweep: {space: {optim.lr: {type: float, low: 0.1, high: 0.01}}}", "below high"),
    ("sweep: {promotion: {require_reproducible: true}, space: {x: {type: int, low: 0, high: 1}}}", "top_k"),
])
def test_incoherent_sweep_sections_are_refused_with_one_line_naming_the_fix(sweep, complaint):
    with pytest.raises(SpecError) as e:
        load_spec_text(TINY_DIGITS + sweep)
    assert complaint in str(e.value) and "\n" not in str(e.value)


def test_a_search_space_path_that_is_not_a_spec_field_fails_before_any_trial():
    from traingate.sweep.space import check_space

    spec = load_spec_text(TINY_DIGITS + "sweep: {space: {optim.lrr: {type: float, low: 0.001, high: 0.1}}}")
    with pytest.raises(SpecError, match=r"sweep.space.optim.lrr.*unknown key"):
        check_space(spec)


def test_best_config_is_written_as_a_ready_to_run_spec(tmp_path):
    from traingate.sweep.space import trial_spec, write_spec

    base = load_spec_text(TINY_DIGITS + SPACE % "")
    path = write_spec(trial_spec(base, {"optim.lr": 0.02, "recipe.params.hidden": 8}), tmp_path / "best.yaml", "best")
    spec = load_spec(path)
    assert spec.optim.lr == 0.02 and spec.recipe.params["hidden"] == 8 and spec.sweep is None
    assert path.read_text().startswith("# best\n")


def test_reseeded_reruns_pick_the_winner_and_fail_it_when_it_does_not_hold_up():
    from traingate.sweep.results import Reproduction, reproducibility

    sw = load_spec_text(TINY_DIGITS + SPACE % ", promotion: {top_k: 2, tolerance: 0.01}").sweep
    ok = reproducibility([Reproduction(3, {}, 0.95, [0.945, 0.95]), Reproduction(5, {}, 0.96, [0.90, 0.91])], sw)
    assert ok.passed and ok.winner == 3
    bad = reproducibility([Reproduction(3, {}, 0.99, [0.93, 0.94])], sw)
    assert not bad.passed and "tolerance" in bad.reasons[0]


def test_in_process_trial_stops_at_the_step_its_progress_callback_prunes(tmp_path):
    from traingate.sweep.inprocess import run_stage

    spec = load_spec_text(TINY_DIGITS, ["stages.canary.max_steps=40"])
    seen = []
    r = run_stage(spec, "canary", tmp_path / "t", eval_every=10,
                  on_progress=lambda rec: seen.append(rec["step"]) or rec["step"] >= 20)
    assert r["status"] == "stopped" and r["steps"] == 20 and seen == [10, 20]
    lines = [json.loads(x) for x in (tmp_path / "t" / "progress.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [10, 20] and 0 <= lines[-1]["val_accuracy"] <= 1


def test_pbt_exploit_copies_a_top_members_checkpoint_and_the_bottom_member_resumes_from_it(tmp_path):
    import random

    from traingate.sweep.inprocess import run_stage
    from traingate.sweep.pbt import Member, copy_checkpoint, plan_generation

    base = ["checkpoint.every_steps=10", "checkpoint.async_save=false", "tracking.enabled=false"]
    top = load_spec_text(TINY_DIGITS, base + ["stages.canary.max_steps=20", "optim.lr=0.02"])
    run_stage(top, "canary", tmp_path / "top", checkpoint_uri=(tmp_path / "ck-top").as_uri())
    space = load_spec_text(TINY_DIGITS + "sweep: {space: {recipe.params.dropout: {type: float, low: 0, high: 0.5}}}"
                           ).sweep.space
    plans = plan_generation([Member("top", {"recipe.params.dropout": 0.1}, 0.8),
                             Member("bottom", {"recipe.params.dropout": 0.3}, 0.2)],
                            space, 0.5, [0.8, 1.2], "maximize", random.Random(1))
    assert [(p.dst, p.src) for p in plans] == [("bottom", "top")]
    assert plans[0].params["recipe.params.dropout"] in (pytest.approx(0.08), pytest.approx(0.12))
    assert copy_checkpoint((tmp_path / "ck-top").as_uri(), (tmp_path / "ck-bottom").as_uri()) == 20
    child = load_spec_text(TINY_DIGITS, base + ["stages.canary.max_steps=30", "optim.lr=0.02",
                                                f"recipe.params.dropout={plans[0].params['recipe.params.dropout']}"])
    r = run_stage(child, "canary", tmp_path / "bottom", checkpoint_uri=(tmp_path / "ck-bottom").as_uri())
    assert r["status"] == "completed" and r["metrics"]["resumed_from_step"] == 20 and r["steps"] == 30


def test_fence_stops_an_orphaned_trainer_still_writing_into_the_trial_dir(tmp_path):
    from traingate.sweep.fence import fence, orphans

    # A stand-in trainer: its command line carries the runtime's module name, like the real one.
    # It writes its heartbeat only once running, as the real one does: wait for its first line.
    p = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)",
                          "traingate.runtime.train"], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "up\n"
    (tmp_path / "heartbeat.rank0.json").write_text(json.dumps({"step": 3, "pid": p.pid, "time": time.time()}))
    assert orphans(tmp_path) == [p.pid]
    assert fence(tmp_path, grace_s=10) == [p.pid]
    p.wait(timeout=10)
    assert not psutil.pid_exists(p.pid) and orphans(tmp_path) == []


def test_plots_of_history_and_importance_are_written_and_intermediate_values_are_left_to_mlflow(tmp_path):
    from traingate.sweep.plots import save_plots

    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(4):
        t = study.ask()
        x, y = t.suggest_float("x", 0, 1), t.suggest_int("y", 0, 3)
        t.report(x / 2, 1)
        study.tell(t, x + 0.01 * y)
    names = {p.name for p in save_plots(study, tmp_path, ["score"])}
    assert names == {"optimization_history.png", "param_importances.png"}
    assert all((tmp_path / n).stat().st_size > 1000 for n in names)



def test_pbt_generations_move_bottom_members_onto_a_top_members_checkpoint_with_perturbed_params(tmp_path):
    import random

    from traingate.sweep.inprocess import run_stage
    from traingate.sweep.pbt import Member, run_generations

    space = load_spec_text(TINY_DIGITS + "sweep: {space: {recipe.params.dropout: {type: float, low: 0, high: 0.5}}}"
                           ).sweep.space
    lrs = {"good": 0.05, "bad": 0.0005}  # fixed per member: the copied optimizer state carries lr anyway
    runs = []

    def train(m: Member, until: int) -> float:
        spec = load_spec_text(TINY_DIGITS, ["checkpoint.every_steps=1000", "checkpoint.async_save=false",
                                            "tracking.enabled=false", f"stages.canary.max_steps={until}",
                                            f"optim.lr={lrs[m.key]}", f"recipe.params.dropout={m.params['recipe.params.dropout']}"])
        r = run_stage(spec, "canary", tmp_path / f"gen-{until}" / m.key, checkpoint_uri=(tmp_path / f"ck-{m.key}").as_uri())
        runs.append((m.key, until, r["metrics"]["resumed_from_step"], r["metrics"]["val_accuracy"]))
        return r["metrics"]["val_accuracy"]

    members = [Member("good", {"recipe.params.dropout": 0.1}, None), Member("bad", {"recipe.params.dropout": 0.4}, None)]
    history = run_generations(members, space, 0.5, [0.8, 1.2], "maximize", generations=2, interval=15, train=train,
                              checkpoint_uri=lambda k: (tmp_path / f"ck-{k}").as_uri(), rng=random.Random(0))
    first = {key: acc for key, until, _, acc in runs if until == 15}
    top, bottom = sorted(first, key=first.get, reverse=True)
    assert first[top] > first[bottom]
    assert [(e.dst, e.src) for e in history[0]] == [(bottom, top)]
    src_dropout = {"good": 0.1, "bad": 0.4}[top]
    moved = next(m for m in members if m.key == bottom).params["recipe.params.dropout"]
    assert moved in (pytest.approx(src_dropout * 0.8), pytest.approx(src_dropout * 1.2))
    # Generation 2: both resume at step 15 -- the bottom one from the checkpoint it copied from the top one.
    assert [(k, u, r) for k, u, r, _ in runs] == [("good", 15, 0), ("bad", 15, 0), ("good", 30, 15), ("bad", 30, 15)]
