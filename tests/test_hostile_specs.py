"""The project's adversarial suite: every spec that cannot run is refused before anything starts.

Each case goes through the real CLI entry point (``flows.cli.main``) in this process, a handful
also through a real ``traingate`` subprocess. Every refusal must: exit 2, print exactly one line
on stderr that names the field (and the value where it has one), leave TRAINGATE_STATE_DIR
uncreated and leave no process behind. Stores are real: files under tmp dirs, an S3 endpoint on
loopback (moto), HTTP servers on free loopback ports. The positive controls at the end show the
same machinery accepts the valid tiny spec, so the suite can fail.
"""
from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tgtest import PYTHON, ROOT, TINY_DIGITS, free_port
from traingate.recipes.facts import MAX_CORPUS_BYTES

DIGITS = TINY_DIGITS
CHARGPT = TINY_DIGITS.replace("recipe: {name: digits-cnn, params: {channels: 8, hidden: 32}}",
                              "recipe: {name: char-gpt, params: {block_size: 8, n_layer: 1, n_head: 2, n_embd: 16}}")
SCRIPT = f"""
identity: {{experiment: tests, owner: tester, team: platform, purpose: gate a script in tests}}
recipe:
  name: script
  script:
    command: [python, train.py, --lr, "0.1"]
    workdir: {ROOT}/examples/script_project
    stage_args: {{smoke: [--steps, "5"], canary: [--steps, "30"], full: [--steps, "40"]}}
    metrics: ['step (?P<step>\\d+) loss (?P<loss>\\S+) acc (?P<acc>\\S+)']
    tests: [tests]
"""
SWEEP = ("sweep: {space: {optim.lr: {type: float, low: 0.001, high: 0.1, log: true}}, "
         "objectives: [{metric: val_accuracy, direction: maximize}], scheduler: {name: asha, report_every: 5}}\n")
LONG = "x" * 5000


@dataclass
class Case:
    field: str  # the line must name it
    value: str | None  # ... and show this (None: the error has no single value)
    sets: list[str] = field(default_factory=list)
    base: str = DIGITS
    extra: str = ""  # YAML appended to the base spec
    replace: tuple[str, str] | None = None  # (old, new) edit of the base text
    env: dict[str, str] = field(default_factory=dict)
    cmd: str = "run"  # run (as --dry-run: a spec that slips through must not start a ladder), validate, sweep
    s3: str = ""  # "", "up" (moto endpoint, bucket tg-test), "nocreds" (endpoint up, no credentials)


def case(id_: str, field_: str, value: str | None, *sets: str, **kw) -> pytest.param:
    return pytest.param(Case(field_, value, list(sets), **kw), id=id_)


def _rules(metric: str, value: str = "0") -> str:
    return f"[{{metric: {metric}, op: '>=', value: {value}}}]"


CASES = [
    # -- duplicate YAML keys, in the file and in --set values
    case("dup-section-in-file", "optim", None, extra="optim: {lr: 0.1}\n"),
    case("dup-key-in-flow-mapping", "optim.lr", "0.1", replace=("optim: {lr: 0.05,", "optim: {lr: 0.05, lr: 0.1,")),
    case("dup-key-in-block-mapping", "stages.canary.max_steps", "40",
         replace=("  canary: {max_steps: 20}", "  canary:\n    max_steps: 20\n    max_steps: 40")),
    case("dup-identity-field", "identity.experiment", "other",
         replace=("experiment: tests,", "experiment: tests, experiment: other,")),
    case("dup-key-in-list-item", "gates.canary.rules.0.metric", "steps",
         replace=("{metric: loss_decrease_fraction, op: \">=\", value: 0.05}",
                  "{metric: loss_decrease_fraction, op: \">=\", value: 0.05, metric: steps}")),
    case("dup-top-level-recipe", "recipe", None, extra="recipe: {name: char-gpt}\n"),
    case("dup-key-inside-set-value", "optim.lr", "2", "optim={lr: 1, lr: 2}"),
    case("dup-set-same-key-twice", "optim.lr", "0.2", "optim.lr=0.1", "optim.lr=0.2"),
    case("dup-set-section-then-key", "optim", "0.2", "optim={lr: 0.1}", "optim.lr=0.2"),
    case("dup-set-key-then-section", "stages", None, "stages.canary.max_steps=5", "stages={canary: {max_steps: 6}}"),
    # -- non-finite and absurd numbers
    case("lr-inf-word", "optim.lr", "inf", "optim.lr=inf"),
    case("lr-dot-inf", "optim.lr", "inf", "optim.lr=.inf"),
    case("lr-minus-inf", "optim.lr", "-inf", "optim.lr=-.inf"),
    case("lr-nan-word", "optim.lr", "nan", "optim.lr=nan"),
    case("lr-dot-nan", "optim.lr", "nan", "optim.lr=.nan"),
    case("lr-1e400", "optim.lr", "inf", "optim.lr=1e400"),
    case("lr-1e400-in-file", "optim.lr", "1e400", replace=("optim: {lr: 0.05,", "optim: {lr: 1e400,")),
    case("lr-1.0e+400-in-file", "optim.lr", "inf", replace=("optim: {lr: 0.05,", "optim: {lr: 1.0e+400,")),
    case("weight-decay-inf", "optim.weight_decay", "inf", "optim.weight_decay=.inf"),
    case("max-grad-norm-nan", "optim.max_grad_norm", "nan", "optim.max_grad_norm=.nan"),
    case("price-inf", "pools.cpu-local.price_per_gpu_hour", "inf", "pools.cpu-local.price_per_gpu_hour=.inf"),
    case("price-1e400", "pools.cpu-local.price_per_gpu_hour", "inf", "pools.cpu-local.price_per_gpu_hour=1e400"),
    case("price-absurd", "pools.cpu-local.price_per_gpu_hour", "1000000000.0", "pools.cpu-local.price_per_gpu_hour=1e9"),
    case("budget-inf", "budget.max_cost_usd", "inf", "budget.max_cost_usd=.inf"),
    case("budget-nan", "budget.max_cost_usd", "nan", "budget.max_cost_usd=.nan"),
    case("stage-timeout-inf", "stages.canary.timeout_s", "inf", "stages.canary.timeout_s=.inf"),
    case("stage-timeout-absurd", "stages.canary.timeout_s", "1e+300", "stages.canary.timeout_s=1e300"),
    case("hang-timeout-1e400", "supervision.hang_timeout_s", "inf", "supervision.hang_timeout_s=1e400"),
    case("backoff-absurd", "supervision.backoff_max_s", "1000000000000.0", "supervision.backoff_max_s=1e12"),
    case("grace-nan", "supervision.preempt_grace_s", "nan", "supervision.preempt_grace_s=.nan"),
    case("approval-timeout-inf", "gates.canary.approval_timeout_s", "inf", "gates.canary.approval_timeout_s=.inf"),
    case("gate-value-nan", "gates.canary.rules.0.value", "nan", f"gates.canary.rules={_rules('steps', '.nan')}"),
    case("gate-value-1e400", "gates.canary.rules.0.value", "1e400", f"gates.canary.rules={_rules('steps', '1e400')}"),
    case("val-fraction-nan", "data.val_fraction", "nan", "data.val_fraction=.nan"),
    case("checkpoint-minutes-inf", "checkpoint.every_minutes", "inf", "checkpoint.every_minutes=.inf"),
    case("recipe-param-nan", "recipe.params.dropout", "nan", "recipe.params.dropout=.nan"),
    case("sweep-tolerance-inf", "sweep.promotion.tolerance", "inf", "sweep.promotion.tolerance=.inf", extra=SWEEP),
    case("sweep-wall-1e400", "sweep.budget.max_wall_s", "inf", "sweep.budget.max_wall_s=1e400", extra=SWEEP),
    case("max-steps-inf", "stages.full.max_steps", "inf", "stages.full.max_steps=.inf"),
    case("batch-beyond-64-bits", "optim.batch_size", "9223372036854775808", "optim.batch_size=9223372036854775808"),
    case("seed-2-pow-64", "optim.seed", "18446744073709551616", "optim.seed=18446744073709551616"),
    case("seed-huge", "optim.seed", "99999999999999999999999", "optim.seed=99999999999999999999999"),
    case("seed-beyond-32-bits", "optim.seed", "4294967296", "optim.seed=4294967296"),
    case("sweep-seed-beyond-32-bits", "sweep.seed", "4294967296", "sweep.seed=4294967296", extra=SWEEP),
    case("int-given-true", "optim.batch_size", "True", "optim.batch_size=true"),
    case("int-given-false", "stages.full.max_steps", "False", "stages.full.max_steps=false"),
    case("procs-given-true", "resources.procs_per_node", "True", "resources.procs_per_node=true"),
    case("keep-last-given-true", "checkpoint.keep_last", "True", "checkpoint.keep_last=true"),
    case("float-given-true", "optim.lr", "True", "optim.lr=true"),
    case("gpus-given-true", "pools.cpu-local.gpus_per_node", "True",
         "pools.cpu-local={price_per_gpu_hour: 0.05, gpus_per_node: true}"),
    case("recipe-param-given-true", "recipe.params.channels", "True", "recipe.params.channels=true"),
    case("log-every-given-false", "tracking.log_every", "False", "tracking.log_every=false"),
    case("sweep-trials-given-true", "sweep.n_trials", "True", "sweep.n_trials=true", extra=SWEEP),
    case("perturb-list-given-bools", "sweep.scheduler.pbt_perturb", "True",
         "sweep.scheduler.pbt_perturb=[true, 1.2]", extra=SWEEP),
    # -- rendezvous endpoint
    case("rdzv-garbage", "resources.rdzv_endpoint", "garbage", "resources.nodes=2", "resources.rdzv_endpoint=garbage"),
    case("rdzv-no-port", "resources.rdzv_endpoint", "head:", "resources.nodes=2", "resources.rdzv_endpoint='head:'"),
    case("rdzv-no-host", "resources.rdzv_endpoint", ":29400", "resources.nodes=2", "resources.rdzv_endpoint=:29400"),
    case("rdzv-port-0", "resources.rdzv_endpoint", "head:0", "resources.nodes=2", "resources.rdzv_endpoint=head:0"),
    case("rdzv-port-65536", "resources.rdzv_endpoint", "head:65536", "resources.nodes=2",
         "resources.rdzv_endpoint=head:65536"),
    case("rdzv-port-word", "resources.rdzv_endpoint", "head:port", "resources.nodes=2",
         "resources.rdzv_endpoint=head:port"),
    case("rdzv-space-in-host", "resources.rdzv_endpoint", "he ad:1", "resources.nodes=2",
         "resources.rdzv_endpoint='he ad:1'"),
    case("rdzv-url", "resources.rdzv_endpoint", "tcp://head:29400", "resources.nodes=2",
         "resources.rdzv_endpoint=tcp://head:29400"),
    case("rdzv-two-ports", "resources.rdzv_endpoint", "head:1:2", "resources.nodes=2",
         "resources.rdzv_endpoint=head:1:2"),
    case("rdzv-leading-dash", "resources.rdzv_endpoint", "-head:1", "resources.nodes=2",
         "resources.rdzv_endpoint=-head:1"),
    # -- checkpoint, artifact, tracking and data locations (syntax, installed filesystems, reachability)
    case("ckpt-gs-not-installed", "checkpoint.uri", "gs://bucket/ckpt", "checkpoint.uri=gs://bucket/ckpt"),
    case("ckpt-az-not-installed", "checkpoint.uri", "az://container/ckpt", "checkpoint.uri=az://container/ckpt"),
    case("ckpt-unknown-scheme", "checkpoint.uri", "foo://x", "checkpoint.uri=foo://x"),
    case("ckpt-memory", "checkpoint.uri", "memory://ckpt", "checkpoint.uri=memory://ckpt"),
    case("ckpt-read-only-https", "checkpoint.uri", "https://example.invalid/ckpt",
         "checkpoint.uri=https://example.invalid/ckpt"),
    case("ckpt-relative-file-uri", "checkpoint.uri", "file://relative/ckpt", "checkpoint.uri=file://relative/ckpt"),
    case("ckpt-bad-bucket-name", "checkpoint.uri", "s3://Bad_Bucket/x", "checkpoint.uri=s3://Bad_Bucket/x"),
    case("ckpt-empty-bucket", "checkpoint.uri", "s3:///x", "checkpoint.uri=s3:///x"),
    case("ckpt-under-regular-file", "checkpoint.uri", "<FILE>/ckpt", "checkpoint.uri=file://<FILE>/ckpt"),
    case("ckpt-setting-not-a-uri", "TRAINGATE_CHECKPOINT_URI", "not-a-uri", env={"TRAINGATE_CHECKPOINT_URI": "not-a-uri"}),
    case("ckpt-setting-under-file", "TRAINGATE_CHECKPOINT_URI", "<FILE>/ckpt",
         env={"TRAINGATE_CHECKPOINT_URI": "file://<FILE>/ckpt"}),
    case("state-dir-under-file", "TRAINGATE_STATE_DIR", "<FILE>/state", env={"TRAINGATE_STATE_DIR": "<FILE>/state"}),
    case("artifacts-under-file", "TRAINGATE_ARTIFACT_URI", "<FILE>/art", env={"TRAINGATE_ARTIFACT_URI": "file://<FILE>/art"}),
    case("tracking-sqlite-under-file", "TRAINGATE_TRACKING_URI", "<FILE>/mlflow.db",
         env={"TRAINGATE_TRACKING_URI": "sqlite:///<FILE>/mlflow.db"}),
    case("tracking-sqlite-is-a-dir", "TRAINGATE_TRACKING_URI", "<DIR>", env={"TRAINGATE_TRACKING_URI": "sqlite:///<DIR>"}),
    case("tracking-sqlite-in-memory", "TRAINGATE_TRACKING_URI", "sqlite://", env={"TRAINGATE_TRACKING_URI": "sqlite://"}),
    case("tracking-http-nothing-listens", "TRAINGATE_TRACKING_URI", "127.0.0.1:<DEAD>",
         env={"TRAINGATE_TRACKING_URI": "http://127.0.0.1:<DEAD>"}),
    case("tracking-http-health-500", "TRAINGATE_TRACKING_URI", "127.0.0.1:<H500>",
         env={"TRAINGATE_TRACKING_URI": "http://127.0.0.1:<H500>"}),
    case("tracking-http-never-answers", "TRAINGATE_TRACKING_URI", "127.0.0.1:<SILENT>",
         env={"TRAINGATE_TRACKING_URI": "http://127.0.0.1:<SILENT>"}),
    case("tracking-http-bad-port", "TRAINGATE_TRACKING_URI", "127.0.0.1:99999",
         env={"TRAINGATE_TRACKING_URI": "http://127.0.0.1:99999"}),
    case("tracking-postgres-nothing-listens", "TRAINGATE_TRACKING_URI", "127.0.0.1:<DEAD>",
         env={"TRAINGATE_TRACKING_URI": "postgresql://u@127.0.0.1:<DEAD>/mlflow"}),
    case("tracking-unknown-scheme", "TRAINGATE_TRACKING_URI", "ftp://tracking", env={"TRAINGATE_TRACKING_URI": "ftp://tracking"}),
    case("sweep-optuna-under-file", "TRAINGATE_OPTUNA_STORAGE", "<FILE>/optuna.db", extra=SWEEP,
         env={"TRAINGATE_OPTUNA_STORAGE": "sqlite:///<FILE>/optuna.db"}),
    case("s3-ckpt-bucket-missing", "checkpoint.uri", "s3://tg-missing/ckpt", "checkpoint.uri=s3://tg-missing/ckpt", s3="up"),
    case("s3-ckpt-no-credentials", "checkpoint.uri", "s3://tg-test/ckpt", "checkpoint.uri=s3://tg-test/ckpt", s3="nocreds"),
    case("s3-ckpt-endpoint-down", "checkpoint.uri", "s3://tg-test/ckpt", "checkpoint.uri=s3://tg-test/ckpt", s3="up",
         env={"TRAINGATE_S3_ENDPOINT_URL": "http://127.0.0.1:<DEAD>"}),
    case("s3-ckpt-setting-bucket-missing", "TRAINGATE_CHECKPOINT_URI", "s3://tg-missing/c", s3="up",
         env={"TRAINGATE_CHECKPOINT_URI": "s3://tg-missing/c"}),
    case("s3-script-data-object-missing", "data.uri", "s3://tg-test/missing.csv", "data.uri=s3://tg-test/missing.csv",
         base=SCRIPT, s3="up"),
    case("s3-chargpt-corpus-bucket-missing", "data.uri", "s3://tg-missing/corpus.txt",
         "data.uri=s3://tg-missing/corpus.txt", base=CHARGPT, s3="up"),
    case("s3-chargpt-corpus-no-credentials", "data.uri", "s3://tg-test/corpus.txt", "data.uri=s3://tg-test/corpus.txt",
         base=CHARGPT, s3="nocreds"),
    case("chargpt-corpus-is-a-directory", "data.uri", "<DIR>", "data.uri=file://<DIR>", base=CHARGPT),
    case("chargpt-corpus-is-binary", "data.uri", "<BIN>", "data.uri=file://<BIN>", base=CHARGPT),
    case("chargpt-corpus-is-nul-bytes", "data.uri", "<NUL>", "data.uri=file://<NUL>", base=CHARGPT),
    case("chargpt-corpus-under-regular-file", "data.uri", "<FILE>/c.txt", "data.uri=file://<FILE>/c.txt", base=CHARGPT),
    case("chargpt-corpus-missing", "data.uri", "<TMP>/nope.txt", "data.uri=file://<TMP>/nope.txt", base=CHARGPT),
    case("chargpt-corpus-gs-not-installed", "data.uri", "gs://b/corpus.txt", "data.uri=gs://b/corpus.txt", base=CHARGPT),
    case("chargpt-corpus-unknown-scheme", "data.uri", "foo://corpus", "data.uri=foo://corpus", base=CHARGPT),
    case("script-data-missing", "data.uri", "<TMP>/nope.csv", "data.uri=file://<TMP>/nope.csv", base=SCRIPT),
    case("script-data-memory", "data.uri", "memory://d", "data.uri=memory://d", base=SCRIPT),
    case("script-data-not-a-uri", "data.uri", "/abs/data.csv", "data.uri=/abs/data.csv", base=SCRIPT),
    case("digits-data-elsewhere", "data.uri", "file:///tmp/digits.csv", "data.uri=file:///tmp/digits.csv"),
    # -- malformed --set values and paths, and tags in the file
    case("set-unclosed-list", "optim.lr", "[1,", "optim.lr=[1,"),
    case("set-unclosed-mapping", "optim", "{lr:", "optim={lr:"),
    case("set-python-object-tag", "optim.lr", "python/object/apply", "optim.lr=!!python/object/apply:os.system ['true']"),
    case("set-python-name-tag", "identity.purpose", "python/name", "identity.purpose=!!python/name:os.system"),
    case("set-binary-tag", "optim.lr", "binary", "optim.lr=!!binary aGVsbG8="),
    case("set-set-tag", "optim", "set", "optim=!!set {lr}"),
    case("set-custom-tag", "recipe.params", "!custom", "recipe.params=!custom {channels: 4}"),
    case("set-into-list-index", "gates.canary.rules", "1", "gates.canary.rules.0.value=1"),
    case("set-into-list-index-2", "gates.canary.rules", "x", "gates.canary.rules.1.metric=x"),
    case("set-unknown-section", "foo", "1", "foo.bar=1"),
    case("set-into-a-value", "optim.lr", "0.05", "optim.lr.x=1"),
    case("set-section-to-scalar", "stages.canary", "5", "stages.canary=5"),
    case("set-without-equals", "optim.lr", "optim.lr", "optim.lr"),
    case("set-empty-key-part", "optim..lr", None, "optim..lr=1"),
    case("file-python-tag", "identity.purpose", "python/object/apply",
         replace=("purpose: exercise the ladder in tests}", "purpose: !!python/object/apply:os.system [true]}")),
    case("file-binary-tag", "optim.lr", "binary", replace=("optim: {lr: 0.05,", "optim: {lr: !!binary aGVsbG8=,")),
    case("file-recursive-alias", "x.0", None, extra="x: &a [*a]\n"),
    case("file-alias-bomb", "e", None, extra="a: &a [1,1,1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
         "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
         "e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]\n"),
    case("file-list-as-key", "optim", None, replace=("optim: {lr: 0.05,", "optim: {[a, b]: 1, lr: 0.05,")),
    case("file-top-level-list", "spec", "list", replace=(DIGITS, "- a\n- b\n")),
    # -- gate rules on metrics no stage produces, and a best_metric manifests never hold
    case("gate-metric-typo", "gates.canary.rules.0.metric", "val_acc", f"gates.canary.rules={_rules('val_acc')}"),
    case("gate-unit-on-training-metric", "gates.unit.rules.0.metric", "loss_decrease_fraction",
         f"gates.unit.rules={_rules('loss_decrease_fraction')}"),
    case("gate-smoke-on-test-counts", "gates.smoke.rules.0.metric", "tests_passed",
         f"gates.smoke.rules={_rules('tests_passed')}"),
    case("gate-full-on-unknown-eval", "gates.full.rules.0.metric", "accuracy", f"gates.full.rules={_rules('accuracy')}"),
    case("gate-chargpt-on-digits-eval", "gates.full.rules.0.metric", "val_accuracy",
         f"gates.full.rules={_rules('val_accuracy')}", base=CHARGPT),
    case("gate-second-rule-bad", "gates.canary.rules.1.metric", "cost",
         f"gates.canary.rules=[{{metric: steps, op: '>=', value: 1}}, {{metric: cost, op: '<', value: 1}}]"),
    case("gate-script-unnamed-group", "gates.full.rules.0.metric", "accuracy", f"gates.full.rules={_rules('accuracy')}",
         base=SCRIPT),
    case("gate-script-runtime-metric", "gates.canary.rules.0.metric", "max_grad_norm",
         f"gates.canary.rules={_rules('max_grad_norm')}", base=SCRIPT),
    case("gate-script-default-needs-loss", "gates.canary", "loss_decrease_fraction",
         "recipe.script.metrics=['acc (?P<acc>\\S+)']", base=SCRIPT),
    case("best-metric-not-in-manifests", "checkpoint.best_metric", "val_loss", "checkpoint.best_metric=val_loss",
         "checkpoint.keep_best=2"),
    case("best-metric-typo", "checkpoint.best_metric", "train_los", "checkpoint.best_metric=train_los"),
    # -- commands that cannot start
    case("command-empty-list", "recipe.script.command", "[]", "recipe.script.command=[]", base=SCRIPT),
    case("command-empty-string", "recipe.script.command", "''", "recipe.script.command=['']", base=SCRIPT),
    case("command-blank-string", "recipe.script.command", "'   '", "recipe.script.command=['   ']", base=SCRIPT),
    case("command-empty-argument", "recipe.script.command", "''", "recipe.script.command=[python, '']", base=SCRIPT),
    case("command-python-alone", "recipe.script", "python", "recipe.script.command=[python]", base=SCRIPT),
    case("torchrun-with-bash", "recipe.script", "bash", "recipe.script.command=[bash, run.sh]",
         "recipe.script.launcher=torchrun", base=SCRIPT),
    case("torchrun-with-script-path", "recipe.script", "./train.py", "recipe.script.command=[./train.py]",
         "recipe.script.launcher=torchrun", base=SCRIPT),
    case("stage-args-empty", "recipe.script.stage_args", "''", "recipe.script.stage_args={smoke: ['']}", base=SCRIPT),
    case("tests-empty-path", "recipe.script.tests", "''", "recipe.script.tests=['']", base=SCRIPT),
    case("command-not-found", "recipe.script.command[0]", "no-such-binary-xyz",
         "recipe.script.command=[no-such-binary-xyz]", base=SCRIPT),
    case("script-given-recipe-params", "recipe", "lr", "recipe.params={lr: 0.1}", base=SCRIPT),
    # -- sweep spaces and objectives
    case("space-unknown-path", "sweep.space.optim.lrr", None,
         extra="sweep: {space: {optim.lrr: {type: float, low: 0.001, high: 0.1}}}\n"),
    case("space-unknown-recipe-param", "sweep.space.recipe.params.widht", None,
         extra="sweep: {space: {recipe.params.widht: {type: int, low: 8, high: 64}}}\n"),
    case("space-unknown-section", "sweep.space.model.depth", None,
         extra="sweep: {space: {model.depth: {type: int, low: 1, high: 4}}}\n"),
    case("space-path-through-a-value", "sweep.space.optim.lr.scale", None,
         extra="sweep: {space: {optim.lr.scale: {type: float, low: 0.1, high: 1}}}\n"),
    case("space-into-a-list", "sweep.space.gates.canary.rules", None,
         extra="sweep: {space: {gates.canary.rules: {type: categorical, choices: [1, 2]}}}\n"),
    case("space-into-sweep", "sweep.space.sweep.n_trials", None,
         extra="sweep: {space: {sweep.n_trials: {type: int, low: 1, high: 4}}}\n"),
    case("space-float-range-into-int", "sweep.space.optim.batch_size", "float",
         extra="sweep: {space: {optim.batch_size: {type: float, low: 8, high: 64}}}\n"),
    case("space-float-range-into-recipe-int", "sweep.space.recipe.params.hidden", "float",
         extra="sweep: {space: {recipe.params.hidden: {type: float, low: 8, high: 64}}}\n"),
    case("space-string-choices-into-float", "sweep.space.optim.lr", "str",
         extra="sweep: {space: {optim.lr: {type: categorical, choices: ['0.1', '0.01']}}}\n"),
    case("space-float-choices-into-int", "sweep.space.recipe.params.hidden", "float",
         extra="sweep: {space: {recipe.params.hidden: {type: categorical, choices: [16.5, 32]}}}\n"),
    case("space-bool-choices-into-int", "sweep.space.optim.batch_size", "bool",
         extra="sweep: {space: {optim.batch_size: {type: categorical, choices: [true, false]}}}\n"),
    case("space-int-range-into-enum", "sweep.space.optim.schedule", "int",
         extra="sweep: {space: {optim.schedule: {type: int, low: 0, high: 1}}}\n"),
    case("space-enum-choice-not-allowed", "sweep.space.optim.schedule", "linear",
         extra="sweep: {space: {optim.schedule: {type: categorical, choices: [cosine, linear]}}}\n"),
    case("space-step-larger-than-range", "sweep.space.optim.lr", "0.5",
         extra="sweep: {space: {optim.lr: {type: float, low: 0.01, high: 0.1, step: 0.5}}}\n"),
    case("space-int-step-fractional", "sweep.space.optim.warmup_steps", "1.5",
         extra="sweep: {space: {optim.warmup_steps: {type: int, low: 0, high: 10, step: 1.5}}}\n"),
    case("space-low-above-high", "sweep.space.optim.lr", "0.1",
         extra="sweep: {space: {optim.lr: {type: float, low: 0.1, high: 0.01}}}\n"),
    case("space-log-low-zero", "sweep.space.optim.lr", "0",
         extra="sweep: {space: {optim.lr: {type: float, low: 0, high: 0.1, log: true}}}\n"),
    case("space-log-low-negative", "sweep.space.optim.lr", "-1",
         extra="sweep: {space: {optim.lr: {type: float, low: -1, high: 0.1, log: true}}}\n"),
    case("space-range-outside-field-bounds", "sweep.space.optim.lr", "-1",
         extra="sweep: {space: {optim.lr: {type: float, low: -1, high: 0.1}}}\n"),
    case("space-unhashable-list-choices", "sweep.space.optim.batch_size.choices", "[16, 32]",
         extra="sweep: {space: {optim.batch_size: {type: categorical, choices: [[16, 32], [64]]}}}\n"),
    case("space-unhashable-mapping-choices", "sweep.space.optim.batch_size.choices", "{'a': 1}",
         extra="sweep: {space: {optim.batch_size: {type: categorical, choices: [{a: 1}]}}}\n"),
    case("space-duplicate-choices", "sweep.space.optim.batch_size.choices", "16",
         extra="sweep: {space: {optim.batch_size: {type: categorical, choices: [16, 16]}}}\n"),
    case("space-when-value-never-taken", "space.optim.warmup_steps.when", "linear",
         extra="sweep: {space: {optim.schedule: {type: categorical, choices: [constant, cosine]}, "
               "optim.warmup_steps: {type: int, low: 0, high: 5, when: {optim.schedule: linear}}}}\n"),
    case("space-script-recipe-params", "sweep.space.recipe.params.lr", None, base=SCRIPT,
         extra="sweep: {space: {recipe.params.lr: {type: float, low: 0.01, high: 0.1}}, "
               "objectives: [{metric: acc}]}\n"),
    case("objective-never-reported", "sweep.objectives.0.metric", "val_acc",
         extra="sweep: {space: {optim.lr: {type: float, low: 0.001, high: 0.1}}, objectives: [{metric: val_acc}]}\n"),
    case("objective-chargpt-accuracy", "sweep.objectives.0.metric", "val_accuracy", base=CHARGPT,
         extra="sweep: {space: {optim.lr: {type: float, low: 0.001, high: 0.1}}, objectives: [{metric: val_accuracy}]}\n"),
    case("objective-second-never-reported", "sweep.objectives.1.metric", "price",
         extra="sweep: {space: {optim.lr: {type: float, low: 0.001, high: 0.1}}, "
               "objectives: [{metric: val_accuracy}, {metric: price, direction: minimize}]}\n"),
    case("pruner-on-a-final-only-metric", "sweep.scheduler.name", "asha",
         extra="sweep: {space: {optim.lr: {type: float, low: 0.001, high: 0.1}}, "
               "objectives: [{metric: cost_usd, direction: minimize}], scheduler: {name: asha}}\n"),
    case("sweep-command-space-type-mismatch", "sweep.space.optim.batch_size", "float", cmd="sweep",
         extra="sweep: {space: {optim.batch_size: {type: float, low: 8, high: 64}}}\n"),
    case("sweep-command-pbt-interval-without-pbt", "sweep.scheduler.pbt_interval", "5", "sweep.scheduler.pbt_interval=5",
         extra=SWEEP, cmd="sweep"),
    case("sweep-command-objective", "sweep.objectives.0.metric", "val_acc", cmd="sweep",
         extra="sweep: {space: {optim.lr: {type: float, low: 0.001, high: 0.1}}, objectives: [{metric: val_acc}]}\n"),
    # -- names that become paths, NUL characters, overlong names
    case("experiment-traversal", "identity.experiment", "../../x", "identity.experiment=../../x"),
    case("experiment-dot-dot", "identity.experiment", "..", "identity.experiment=.."),
    case("experiment-absolute", "identity.experiment", "/etc/x", "identity.experiment=/etc/x"),
    case("experiment-slash", "identity.experiment", "a/b", "identity.experiment=a/b"),
    case("experiment-5000-chars", "identity.experiment", LONG[:60], f"identity.experiment={LONG}"),
    case("experiment-space", "identity.experiment", "my exp", "identity.experiment='my exp'"),
    case("experiment-hidden", "identity.experiment", ".hidden", "identity.experiment=.hidden"),
    case("experiment-at-sign", "identity.experiment", "exp@v2", "identity.experiment=exp@v2"),
    case("experiment-nul", "identity.experiment", "x\\x00y", replace=("experiment: tests,", 'experiment: "x\\0y",')),
    case("run-name-traversal", "identity.run_name", "../r", "identity.run_name=../r"),
    case("run-name-5000-chars", "identity.run_name", LONG[:60], f"identity.run_name={LONG}"),
    case("team-traversal", "identity.team", "../../t", "identity.team=../../t"),
    case("team-backslash", "identity.team", "a\\\\b", "identity.team=a\\b"),
    case("owner-traversal", "identity.owner", "../o", "identity.owner=../o"),
    case("owner-5000-chars", "identity.owner", LONG[:60], f"identity.owner={LONG}"),
    case("study-traversal", "sweep.study", "../../s", "sweep.study=../../s", extra=SWEEP),
    case("study-5000-chars", "sweep.study", LONG[:60], f"sweep.study={LONG}", extra=SWEEP),
    case("pool-name-traversal", "pools", "../p", "pools={'../p': {price_per_gpu_hour: 1}}", "resources.work_pool=../p"),
    case("purpose-5000-chars", "identity.purpose", LONG[:60], f"identity.purpose={LONG}"),
    case("purpose-escape-char", "identity.purpose", "\\x1b", replace=("purpose: exercise the ladder in tests}", 'purpose: "\\e[31m exercise"}')),
    case("purpose-nul-in-set", "identity.purpose", "x\\x00y", "identity.purpose=x\x00y"),
    case("nul-in-data-uri", "data.uri", "\\x00", replace=("optim:", 'data: {uri: "file:///tmp/a\\0b"}\noptim:'),
         base=CHARGPT),
    case("nul-in-command-argument", "recipe.script.command.1", "\\x00",
         replace=('command: [python, train.py, --lr, "0.1"]', 'command: [python, "train\\0.py"]'), base=SCRIPT),
    case("nul-in-key", "optim", "\\x00", replace=("optim: {lr: 0.05,", 'optim: {"l\\0r": 1, lr: 0.05,')),
    # -- special files where data or a directory is expected: reading one blocks (FIFO, socket) or never ends
    case("special-chargpt-corpus-fifo", "data.uri", "<FIFO>", "data.uri=file://<FIFO>", base=CHARGPT),
    case("special-chargpt-corpus-socket", "data.uri", "<SOCK>", "data.uri=file://<SOCK>", base=CHARGPT),
    case("special-chargpt-corpus-dev-zero", "data.uri", "/dev/zero", "data.uri=file:///dev/zero", base=CHARGPT),
    case("special-chargpt-corpus-dev-urandom", "data.uri", "/dev/urandom", "data.uri=file:///dev/urandom",
         base=CHARGPT),
    case("special-script-data-fifo", "data.uri", "<FIFO>", "data.uri=file://<FIFO>", base=SCRIPT),
    case("special-script-data-socket", "data.uri", "<SOCK>", "data.uri=file://<SOCK>", base=SCRIPT),
    case("special-script-data-dev-zero", "data.uri", "/dev/zero", "data.uri=file:///dev/zero", base=SCRIPT),
    case("special-workdir-holds-a-fifo", "recipe.script.workdir", "<PROJ_FIFO>",
         replace=(f"{ROOT}/examples/script_project", "<PROJ_FIFO>"), base=SCRIPT),
    case("special-checkpoint-root-is-a-fifo", "checkpoint.uri", "<FIFO>", "checkpoint.uri=file://<FIFO>"),
    case("special-state-dir-is-a-fifo", "TRAINGATE_STATE_DIR", "<FIFO>", env={"TRAINGATE_STATE_DIR": "<FIFO>"}),
    case("special-tracking-db-is-a-fifo", "TRAINGATE_TRACKING_URI", "<FIFO>",
         env={"TRAINGATE_TRACKING_URI": "sqlite:///<FIFO>"}),
    case("special-tracking-db-is-dev-null", "TRAINGATE_TRACKING_URI", "/dev/null",
         env={"TRAINGATE_TRACKING_URI": "sqlite:////dev/null"}),
    # -- sizes: counts, grids, models and files no machine holds
    case("size-grid-one-huge-range", "sweep", "1e+18", extra="sweep: {space: {optim.warmup_steps: {type: int, "
         "low: 0, high: 1000000000000000000}}, sampler: grid, objectives: [{metric: val_accuracy}]}\n"),
    case("size-grid-product-of-ranges", "sweep", "1e+12", extra="sweep: {space: {optim.warmup_steps: {type: int, "
         "low: 1, high: 1000}, optim.batch_size: {type: int, low: 1, high: 1000}, recipe.params.hidden: {type: int, "
         "low: 1, high: 1000}, recipe.params.channels: {type: int, low: 1, high: 1000}}, sampler: grid}\n"),
    case("size-grid-fine-float-step", "sweep", "1e+09", extra="sweep: {space: {optim.lr: {type: float, low: 0.0, "
         "high: 1.0, step: 0.000000001}}, sampler: grid}\n"),
    case("size-n-trials", "sweep.n_trials", "1000000000000000000", "sweep.n_trials=1000000000000000000", extra=SWEEP),
    case("size-max-concurrent", "sweep.max_concurrent", "10000000", "sweep.max_concurrent=10000000", extra=SWEEP),
    case("size-population", "sweep.population_size", "1000000000", "sweep.population_size=1000000000", extra=SWEEP),
    case("size-procs-per-node", "resources.procs_per_node", "100000", "resources.procs_per_node=100000", base=SCRIPT),
    case("size-nodes", "resources.nodes", "1000000", "resources.nodes=1000000", "resources.rdzv_endpoint=h:1",
         base=SCRIPT),
    case("size-digits-model", "recipe.params", "1000000000000", "recipe.params.hidden=1000000000000"),
    case("size-chargpt-model-overflows", "recipe.params", "1000000000", "recipe.params.n_embd=1000000000",
         "recipe.params.n_head=1", base=CHARGPT),
    case("size-chargpt-model-too-many-layers", "recipe.params", "2000", "recipe.params.n_layer=2000",
         "recipe.params.n_embd=4096", base=CHARGPT),
    case("size-chargpt-corpus-huge", "data.uri", "<BIG>", "data.uri=file://<BIG>", base=CHARGPT),
    case("size-workdir-too-many-files", "recipe.script.workdir", "<PROJ_MANY>",
         replace=(f"{ROOT}/examples/script_project", "<PROJ_MANY>"), base=SCRIPT),
    # -- nesting depth: every tree walk recurses per level
    case("depth-params-list-300", "recipe.params.deep", None,
         replace=("params: {channels: 8, hidden: 32}", "params: {channels: 8, deep: " + "[" * 300 + "]" * 300 + "}")),
    case("depth-file-list-5000", "x.0.0", None, extra="x: " + "[" * 5000 + "]" * 5000 + "\n"),
    case("depth-file-mapping-40", "recipe.params.a", None,
         replace=("params: {channels: 8, hidden: 32}", "params: " + "{a: " * 40 + "1" + "}" * 40)),
    case("depth-set-dotted-key-300", "recipe.params.a", None, "recipe.params." + ".".join(["a"] * 300) + "=1"),
    case("depth-set-value-300", "recipe.params.x", None, "recipe.params.x=" + "[" * 300 + "]" * 300),
    # -- ${env:NAME} references to unset variables, wherever a string may hold one
    case("env-unset-in-script-command", "recipe.script.command[2]", "TG_HOSTILE_UNSET",
         "recipe.script.command=[python, train.py, '${env:TG_HOSTILE_UNSET}']", base=SCRIPT),
    case("env-unset-in-stage-args", "recipe.script.stage_args.smoke[1]", "TG_HOSTILE_UNSET",
         "recipe.script.stage_args={smoke: [--steps, '${env:TG_HOSTILE_UNSET}']}", base=SCRIPT),
    case("env-unset-in-resume-args", "recipe.script.resume_args[0]", "TG_HOSTILE_UNSET",
         "recipe.script.resume_args=['${env:TG_HOSTILE_UNSET}']", base=SCRIPT),
    case("env-unset-in-script-data-uri", "data.uri", "TG_HOSTILE_UNSET",
         "data.uri=file:///tmp/${env:TG_HOSTILE_UNSET}", base=SCRIPT),
    case("env-unset-in-chargpt-corpus", "data.uri", "TG_HOSTILE_UNSET", "data.uri=s3://b/${env:TG_HOSTILE_UNSET}",
         base=CHARGPT),
    case("env-unset-in-checkpoint-uri", "checkpoint.uri", "TG_HOSTILE_UNSET",
         "checkpoint.uri=s3://bucket/${env:TG_HOSTILE_UNSET}"),
    case("env-unset-in-webhook", "alerts.webhook_url", "TG_HOSTILE_UNSET",
         "alerts.webhook_url=https://hooks.example/${env:TG_HOSTILE_UNSET}"),
    case("env-unset-in-purpose", "identity.purpose", "TG_HOSTILE_UNSET", "identity.purpose=a ${env:TG_HOSTILE_UNSET}"),
    case("env-unset-in-recipe-param", "recipe.params.token", "TG_HOSTILE_UNSET",
         "recipe.params.token=${env:TG_HOSTILE_UNSET}", base=CHARGPT),
    case("env-unset-in-tracking-setting", "TRAINGATE_TRACKING_URI", "TG_HOSTILE_UNSET",
         env={"TRAINGATE_TRACKING_URI": "sqlite:///<TMP>/${env:TG_HOSTILE_UNSET}.db"}),
    case("env-unset-in-checkpoint-setting", "TRAINGATE_CHECKPOINT_URI", "TG_HOSTILE_UNSET",
         env={"TRAINGATE_CHECKPOINT_URI": "file:///tmp/${env:TG_HOSTILE_UNSET}"}),
    case("env-ref-in-state-dir", "TRAINGATE_STATE_DIR", "TG_HOSTILE_UNSET",
         env={"TRAINGATE_STATE_DIR": "<TMP>/${env:TG_HOSTILE_UNSET}/state"}),
    # -- ${env:NAME} the allowlist does not name, or resolved into a URL to a host it does not name
    case("env-set-but-not-on-allowlist", "alerts.webhook_url", "TG_HOSTILE_SET",
         "alerts.webhook_url=https://hooks.example/${env:TG_HOSTILE_SET}", env={"TG_HOSTILE_SET": "hook-value"}),
    case("env-allowed-into-a-foreign-host", "alerts.webhook_url", "collector.example",
         "alerts.webhook_url=https://collector.example/c?k=${env:TG_HOSTILE_SET}",
         env={"TG_HOSTILE_SET": "v", "TRAINGATE_ENV_ALLOW": "TG_HOSTILE_SET"}),
    case("env-not-on-allowlist-in-validate", "data.uri", "TG_HOSTILE_SET", "data.uri=s3://b/${env:TG_HOSTILE_SET}",
         base=CHARGPT, cmd="validate", env={"TG_HOSTILE_SET": "v"}),
    # -- URL fields: a scheme, a host, a port
    case("url-webhook-no-scheme", "alerts.webhook_url", "hooks.example/x", "alerts.webhook_url=hooks.example/x"),
    case("url-webhook-ftp", "alerts.webhook_url", "ftp://hooks.example/x", "alerts.webhook_url=ftp://hooks.example/x"),
    case("url-webhook-no-host", "alerts.webhook_url", "https:///x", "alerts.webhook_url=https:///x"),
    case("url-webhook-bad-port", "alerts.webhook_url", "https://hooks.example:99999/x",
         "alerts.webhook_url=https://hooks.example:99999/x"),
    case("url-checkpoint-s3-no-bucket", "checkpoint.uri", "s3:///ckpt", "checkpoint.uri=s3:///ckpt"),
    case("url-s3-endpoint-no-scheme", "TRAINGATE_S3_ENDPOINT_URL", "minio:9000",
         env={"TRAINGATE_S3_ENDPOINT_URL": "minio:9000"}),
    case("url-tracking-no-host", "TRAINGATE_TRACKING_URI", "http:///mlflow", env={"TRAINGATE_TRACKING_URI": "http:///mlflow"}),
    # -- paths: the root, kernel trees, unwritable places and missing parents
    case("path-state-dir-root", "TRAINGATE_STATE_DIR", "/", env={"TRAINGATE_STATE_DIR": "/"}),
    case("path-state-dir-proc", "TRAINGATE_STATE_DIR", "/proc/traingate", env={"TRAINGATE_STATE_DIR": "/proc/traingate"}),
    case("path-state-dir-sys", "TRAINGATE_STATE_DIR", "/sys/traingate", env={"TRAINGATE_STATE_DIR": "/sys/traingate"}),
    case("path-state-dir-dev", "TRAINGATE_STATE_DIR", "/dev/traingate", env={"TRAINGATE_STATE_DIR": "/dev/traingate"}),
    case("path-state-dir-cgroup", "TRAINGATE_STATE_DIR", "/sys/fs/cgroup/tg", env={"TRAINGATE_STATE_DIR": "/sys/fs/cgroup/tg"}),
    case("path-checkpoint-root", "checkpoint.uri", "file:///", "checkpoint.uri=file:///"),
    case("path-checkpoint-proc", "checkpoint.uri", "/proc/self/ckpt", "checkpoint.uri=file:///proc/self/ckpt"),
    case("path-checkpoint-setting-sys", "TRAINGATE_CHECKPOINT_URI", "/sys/ckpt",
         env={"TRAINGATE_CHECKPOINT_URI": "file:///sys/ckpt"}),
    case("path-artifacts-dev", "TRAINGATE_ARTIFACT_URI", "/dev/artifacts", env={"TRAINGATE_ARTIFACT_URI": "file:///dev/artifacts"}),
    case("path-tracking-db-proc", "TRAINGATE_TRACKING_URI", "/proc/mlflow.db",
         env={"TRAINGATE_TRACKING_URI": "sqlite:////proc/mlflow.db"}),
    case("path-optuna-db-sys", "TRAINGATE_OPTUNA_STORAGE", "/sys/optuna.db", extra=SWEEP,
         env={"TRAINGATE_OPTUNA_STORAGE": "sqlite:////sys/optuna.db"}),
    case("path-workdir-root", "recipe.script.workdir", "/", replace=(f"{ROOT}/examples/script_project", "/"),
         base=SCRIPT),
    case("path-workdir-proc", "recipe.script.workdir", "/proc", replace=(f"{ROOT}/examples/script_project", "/proc"),
         base=SCRIPT),
    case("path-workdir-missing", "recipe.script.workdir", "<TMP>/no-such-project",
         replace=(f"{ROOT}/examples/script_project", "<TMP>/no-such-project"), base=SCRIPT),
    case("path-chargpt-corpus-in-proc", "data.uri", "/proc/self/status", "data.uri=file:///proc/self/status",
         base=CHARGPT),
    case("path-script-data-in-sys", "data.uri", "/sys/kernel", "data.uri=file:///sys/kernel", base=SCRIPT),
    case("path-state-dir-parent-is-a-fifo", "TRAINGATE_STATE_DIR", "<FIFO>/state",
         env={"TRAINGATE_STATE_DIR": "<FIFO>/state"}),
]


# ---------------------------------------------------------------- the world the cases point at

class _Health500(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's API
        self.send_response(500)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


class _Health200(_Health500):
    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b"OK")


@pytest.fixture(scope="module")
def servers():
    """HTTP servers on free loopback ports: /health answers 500, or 200; and a port that accepts, never answers."""
    started = []
    ports = {}
    for name, handler in (("H500", _Health500), ("H200", _Health200)):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        started.append(srv)
        ports[name] = str(srv.server_address[1])
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes the handshake; nobody ever reads or answers
    ports["SILENT"] = str(silent.getsockname()[1])
    ports["DEAD"] = str(free_port())
    yield ports
    for srv in started:
        srv.shutdown()
        srv.server_close()
    silent.close()


@pytest.fixture
def world(tmp_path, servers, monkeypatch, request):
    """Placeholders -> real paths and ports: a regular file, a directory, a binary and a NUL-filled file."""
    from traingate.ladder import preflight as validate

    monkeypatch.setattr(validate, "PROBE_TIMEOUT_S", 1.0)  # the never-answering server costs 1 s, not 5
    files = tmp_path / "files"
    files.mkdir()
    (files / "afile").write_text("a regular file\n")
    (files / "adir").mkdir()
    (files / "binary.bin").write_bytes(bytes(range(128, 256)) * 16)
    (files / "zeros.txt").write_bytes(b"\0" * 4096)
    os.mkfifo(files / "fifo")
    with open(files / "big.txt", "wb") as f:  # sparse: larger than char-gpt's corpus limit, no disk used
        f.truncate(MAX_CORPUS_BYTES + 1)
    proj_fifo = files / "proj-fifo"
    shutil.copytree(ROOT / "examples" / "script_project", proj_fifo)
    os.mkfifo(proj_fifo / "pipe")
    proj_many = files / "proj-many"
    shutil.copytree(ROOT / "examples" / "script_project", proj_many)
    monkeypatch.setattr(validate, "MAX_PROJECT_FILES", 40)  # the limit's logic, without writing 20,000 files
    for i in range(50):
        (proj_many / f"sample_{i}.txt").write_text("x")
    short = Path(tempfile.mkdtemp(prefix="tg-sock-", dir="/tmp"))  # a socket path must be under 108 bytes
    request.addfinalizer(lambda: shutil.rmtree(short, ignore_errors=True))
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(short / "s"))
    request.addfinalizer(sock.close)
    return {"<FILE>": str(files / "afile"), "<DIR>": str(files / "adir"), "<BIN>": str(files / "binary.bin"),
            "<NUL>": str(files / "zeros.txt"), "<FIFO>": str(files / "fifo"), "<SOCK>": str(short / "s"),
            "<BIG>": str(files / "big.txt"), "<PROJ_FIFO>": str(proj_fifo), "<PROJ_MANY>": str(proj_many),
            "<TMP>": str(files), **{f"<{k}>": v for k, v in servers.items()}}


def _fill(text: str, world: dict[str, str]) -> str:
    for k, v in world.items():
        text = text.replace(k, v)
    return text


def _spec_text(c: Case) -> str:
    text = c.base
    if c.replace:
        assert c.replace[0] in text, f"the case edits text that is not in its base: {c.replace[0]!r}"
        text = text.replace(*c.replace)
    return text + c.extra


def _no_credentials(monkeypatch, tmp_path) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to find here


def _assert_refused(rc: int, err: str, c: Case, world: dict[str, str], state_dir: Path) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, f"exit {rc}, stderr: {err[-2000:]}"
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {err[-2000:]}"
    line = lines[0]
    assert line.startswith("traingate: invalid spec: "), line
    assert _fill(c.field, world) in line, f"the line does not name {c.field!r}: {line}"
    if c.value is not None:
        assert _fill(c.value, world) in line, f"the line does not show the value {c.value!r}: {line}"
    assert not state_dir.exists(), f"a refused spec created {state_dir}"
    return line


@pytest.mark.parametrize("c", CASES)
def test_a_hostile_spec_is_refused_in_one_line_and_creates_nothing(c, world, state_dir, tmp_path, monkeypatch,
                                                                    capsys, request):
    from flows.cli import main

    if c.s3:
        request.getfixturevalue("s3_server")
        if c.s3 == "nocreds":
            _no_credentials(monkeypatch, tmp_path)
    for k, v in c.env.items():
        monkeypatch.setenv(k, _fill(v, world))
    monkeypatch.delenv("TG_HOSTILE_UNSET", raising=False)
    if "TG_HOSTILE_SET" not in c.env:
        monkeypatch.delenv("TG_HOSTILE_SET", raising=False)
    if "TRAINGATE_STATE_DIR" in c.env:
        state_dir = Path(_fill(c.env["TRAINGATE_STATE_DIR"], world))
        if state_dir.exists():  # the root, a FIFO: what must not appear is the state dir's contents
            state_dir = state_dir / "runs"
    spec = tmp_path / "spec.yaml"
    spec.write_text(_fill(_spec_text(c), world))
    args = [c.cmd, str(spec), *[a for s in c.sets for a in ("--set", _fill(s, world))]]
    if c.cmd == "run":
        args.append("--dry-run")
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    capsys.readouterr()
    rc = main(args)
    err = capsys.readouterr().err
    _assert_refused(rc, err, c, world, state_dir)
    assert {p.pid for p in me.children(recursive=True)} <= before, "a refused spec left a process behind"


def test_the_suite_covers_every_class_with_at_least_120_cases():
    ids = [p.id for p in CASES]
    assert len(ids) >= 120 and len(set(ids)) == len(ids)
    for prefix in ("dup-", "lr-", "seed-", "int-given", "rdzv-", "ckpt-", "s3-", "chargpt-corpus", "set-", "file-",
                   "gate-", "best-metric", "command-", "torchrun-", "space-", "objective-", "experiment-", "study-",
                   "special-", "size-", "depth-", "env-", "path-", "url-"):
        assert any(i.startswith(prefix) for i in ids), prefix


def test_a_checkpoint_root_in_a_read_only_directory_is_refused(world, state_dir, tmp_path, capsys):
    """Root may write anywhere, so the directory is also made immutable (ext4 chattr) when running as root."""
    from flows.cli import main

    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(0o555)
    immutable = os.geteuid() == 0 and subprocess.run(["chattr", "+i", str(ro)], capture_output=True).returncode == 0
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("cannot make a directory read-only for this user on this filesystem")
        spec = tmp_path / "spec.yaml"
        spec.write_text(DIGITS)
        rc = main(["run", str(spec), "--dry-run", "--set", f"checkpoint.uri=file://{ro}/ckpt"])
        line = _assert_refused(rc, capsys.readouterr().err, Case("checkpoint.uri", f"{ro}/ckpt"), world, state_dir)
        assert "not writable" in line
        assert not (ro / "ckpt").exists()
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(ro)], check=True)
        ro.chmod(0o755)


# ---------------------------------------------------------------- a real `traingate` process

SUBPROCESS_CASES = [
    pytest.param(["run", "<spec>"], "optim: {lr: 0.05, lr: 0.5,", {}, "optim.lr", id="duplicate-key-in-file"),
    pytest.param(["run", "<spec>", "--set", "optim.lr=1e400"], None, {}, "optim.lr", id="lr-1e400"),
    pytest.param(["run", "<spec>", "--set", "identity.experiment=../../x"], None, {}, "../../x", id="traversal"),
    pytest.param(["run", "<spec>", "--set", "optim.lr=!!python/object/apply:os.system ['touch <tmp>/pwned']"], None,
                 {}, "optim.lr", id="python-tag-in-set"),
    pytest.param(["run", "<spec>", "--set", "resources.nodes=2", "--set", "resources.rdzv_endpoint=head:99999"], None,
                 {}, "resources.rdzv_endpoint", id="rdzv-port"),
    pytest.param(["run", "<spec>"], None, {"TRAINGATE_TRACKING_URI": "http://127.0.0.1:<dead>"},
                 "TRAINGATE_TRACKING_URI", id="tracking-server-down"),
    pytest.param(["sweep", "<spec>", "--set", "sweep={space: {optim.batch_size: {type: float, low: 8, high: 64}}}"],
                 None, {}, "sweep.space.optim.batch_size", id="sweep-type-mismatch"),
]


@pytest.mark.parametrize("argv,edit,env,needle", SUBPROCESS_CASES)
def test_the_traingate_command_refuses_with_exit_2_and_leaves_nothing(argv, edit, env, needle, tmp_path):
    exe = Path(PYTHON).parent / "traingate"
    spec = tmp_path / "spec.yaml"
    spec.write_text(DIGITS.replace("optim: {lr: 0.05,", edit) if edit else DIGITS)
    state, prefect_home = tmp_path / "state", tmp_path / "prefect"
    mark = uuid.uuid4().hex
    values = {"<spec>": str(spec), "<tmp>": str(tmp_path), "<dead>": str(free_port())}
    full_env = {**os.environ, "TRAINGATE_STATE_DIR": str(state), "PREFECT_HOME": str(prefect_home),
                "TG_HOSTILE_MARK": mark, **{k: _fill(v, values) for k, v in env.items()}}
    p = subprocess.run([str(exe), *[_fill(a, values) for a in argv]], env=full_env, capture_output=True,
                       text=True, timeout=300)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2, p.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("traingate: invalid spec: ") and needle in lines[0], p.stderr
    assert not state.exists() and not prefect_home.exists(), "a refused spec created state or a Prefect home"
    assert not (tmp_path / "pwned").exists(), "a YAML tag in --set ran code"
    left = [proc.pid for proc in psutil.process_iter(["pid"]) if _has_mark(proc, mark)]
    assert not left, f"processes of the refused command are still running: {left}"


def _has_mark(proc: psutil.Process, mark: str) -> bool:
    try:
        return proc.environ().get("TG_HOSTILE_MARK") == mark
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


# ---------------------------------------------------------------- positive controls: the checks can pass

@pytest.mark.parametrize("base,sets", [
    pytest.param(DIGITS, [], id="tiny-digits"),
    pytest.param(DIGITS, ["identity.owner=alice@example.com", "identity.run_name=r-1.2_x"], id="names-at-the-edge"),
    pytest.param(DIGITS, ["resources.nodes=2", "resources.rdzv_endpoint=head-node.cluster:29400"], id="multi-node"),
    pytest.param(DIGITS, ["resources.nodes=2", "resources.rdzv_endpoint='[::1]:29400'"], id="ipv6-rendezvous"),
    pytest.param(DIGITS + SWEEP, [], id="sweep"),
    pytest.param(DIGITS + SWEEP, ["sweep.space.optim.lr.high=0.05"], id="set-into-a-dotted-space-key"),
    pytest.param(CHARGPT, ["gates.full.rules=[{metric: val_bits_per_char, op: '<', value: 9}]"], id="char-gpt"),
    pytest.param(SCRIPT, ["gates.full.rules=[{metric: acc_max, op: '>=', value: 0.5}]"], id="script"),
])
def test_a_valid_spec_passes_validate_and_the_dry_run_preflight_and_creates_nothing(base, sets, tmp_path, state_dir,
                                                                                     capsys):
    from flows.cli import main

    spec = tmp_path / "spec.yaml"
    spec.write_text(base)
    overrides = [a for s in sets for a in ("--set", s)]
    assert main(["validate", str(spec), *overrides]) == 0, capsys.readouterr().err
    assert main(["run", str(spec), "--dry-run", *overrides]) == 0, capsys.readouterr().err
    assert not state_dir.exists()


def test_preflight_passes_for_reachable_stores(tmp_path, servers, s3_server, monkeypatch):
    from traingate.settings import Settings
    from traingate.spec import load_spec_text
    from traingate.ladder.preflight import preflight

    import boto3

    boto3.client("s3", endpoint_url=s3_server["endpoint"]).put_object(Bucket="tg-test", Key="data/train.csv", Body=b"x")
    spec = load_spec_text(SCRIPT, ["checkpoint.uri=s3://tg-test/ckpt", "data.uri=s3://tg-test/data"])
    settings = Settings.from_env({"TRAINGATE_STATE_DIR": str(tmp_path / "state"),
                                  "TRAINGATE_TRACKING_URI": f"http://127.0.0.1:{servers['H200']}",
                                  "TRAINGATE_S3_ENDPOINT_URL": s3_server["endpoint"]})
    preflight(spec, settings)
    assert not (tmp_path / "state").exists()


def test_a_spec_with_credentials_in_a_uri_is_refused_without_printing_them(world, state_dir, tmp_path, capsys):
    from flows.cli import main

    spec = tmp_path / "spec.yaml"
    spec.write_text(DIGITS)
    rc = main(["run", str(spec), "--dry-run", "--set", "checkpoint.uri=s3://AKIAEXAMPLE:hunter2@Bad_Bucket/x"])
    err = capsys.readouterr().err
    assert rc == 2 and "checkpoint.uri" in err and "hunter2" not in err, err


# ---------------------------------------------------------------- the metric sets are the code's

def test_eval_metric_names_are_what_each_recipe_evaluates():
    import torch

    from traingate.recipes import get_recipe
    from traingate.spec import load_spec_text
    from traingate.ladder.preflight import EVAL_METRICS

    for text, sets in ((DIGITS, []), (CHARGPT, ["recipe.params.max_chars=2000"])):
        recipe = get_recipe(load_spec_text(text, sets))
        torch.manual_seed(0)
        _, val = recipe.load_data()
        out = recipe.evaluate(recipe.build_model(), val.head(4), 4)
        numeric = {k for k, v in out.items() if isinstance(v, (int, float))}
        assert numeric == set(EVAL_METRICS[recipe.name]), recipe.name


def test_runtime_metric_names_are_what_a_real_training_run_reports(tmp_path, state_dir):
    """A real (in-process) trainer: its summary, its profile and its checkpoint manifests."""
    from traingate.ladder import outcomes
    from traingate.spec import load_spec_text
    from traingate.sweep.inprocess import run_stage
    from traingate.ladder.preflight import EVAL_METRICS, MANIFEST_METRICS, PROFILE_METRICS, RUNTIME_METRICS

    spec = load_spec_text(DIGITS, ["resources.procs_per_node=1", "checkpoint.every_steps=2"])
    out = run_stage(spec, "smoke", tmp_path / "stage")
    assert out["status"] == "completed", out
    assert set(out["metrics"]) == set(RUNTIME_METRICS) | set(EVAL_METRICS["digits-cnn"])
    assert set(PROFILE_METRICS) == set(outcomes._PROFILE_KEYS)
    manifests = list((tmp_path / "stage").rglob("manifest.json"))
    assert manifests
    for m in manifests:
        assert set(json.loads(m.read_text())["metrics"]) == set(MANIFEST_METRICS), m


def test_unit_and_script_metric_names_are_what_their_readers_produce(tmp_path):
    from traingate.ladder.outcomes import from_pytest
    from traingate.launch.proc import ProcResult
    from traingate.recipes.script import extract_metrics, summarize
    from traingate.spec import load_spec_text
    from traingate.ladder.preflight import SUPERVISED_METRICS, UNIT_METRICS, stage_metrics

    unit = from_pytest(ProcResult(returncode=0, duration_s=1.0), tmp_path / "none.xml", 1.0)
    assert set(unit.metrics) == set(UNIT_METRICS)
    spec = load_spec_text(SCRIPT)
    log = "step 1 loss 2.0 acc 0.1\nstep 2 loss 1.0 acc 0.6\n"
    produced = set(summarize(extract_metrics(log, spec.recipe.script.metrics)))
    assert produced | set(SUPERVISED_METRICS) == stage_metrics(spec, "canary")
