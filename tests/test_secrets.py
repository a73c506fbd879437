"""traingate.secrets: literal secrets leave the spec as ${env:NAME} references and come back only in memory."""
from __future__ import annotations

import doctest
import json
import os

import pytest
import yaml

import traingate.secrets as secrets_module
from tgtest import ROOT
from traingate.redact import redact_tree
from traingate.secrets import (SecretRefError, check_refs, extract, move_tracking_credentials, protect, protect_spec,
                               refs, resolve, resolve_tree)
from traingate.spec import SpecError, apply_overrides, load_spec_text, parse_spec


def test_module_doctests_pass():
    assert doctest.testmod(secrets_module).failed == 0


def _script_tree() -> dict:
    tree = yaml.safe_load((ROOT / "examples" / "script.yaml").read_text())
    script = tree["recipe"]["script"]
    script["command"] += ["--api-token", "tok-Planted-1", "--endpoint=https://svc/x?sig=sig-Planted-2"]
    script["stage_args"]["smoke"] += ["--password", "pw-Planted-3"]
    tree["data"] = {"uri": "https://data.example/d.csv?X-Amz-Credential=cred-Planted-4&X-Amz-Signature=sig-Planted-5"}
    tree["checkpoint"] = {"uri": "s3://u:pw-Planted-6@bucket/ckpt"}
    return tree


def test_extract_turns_every_literal_secret_in_a_spec_into_a_reference_and_nothing_else():
    original = _script_tree()
    tree, overrides, added = extract(original, env={})
    assert added == {"TRAINGATE_SECRET_1": "tok-Planted-1", "TRAINGATE_SECRET_2": "sig-Planted-2",
                     "TRAINGATE_SECRET_3": "pw-Planted-3", "TRAINGATE_SECRET_4": "cred-Planted-4",
                     "TRAINGATE_SECRET_5": "sig-Planted-5", "TRAINGATE_SECRET_6": "pw-Planted-6"}
    script = tree["recipe"]["script"]
    assert script["command"] == ["python", "train.py", "--lr", "0.1", "--api-token", "${env:TRAINGATE_SECRET_1}",
                                 "--endpoint=https://svc/x?sig=${env:TRAINGATE_SECRET_2}"]
    assert script["stage_args"]["smoke"] == ["--steps", "5", "--password", "${env:TRAINGATE_SECRET_3}"]
    assert tree["data"]["uri"] == ("https://data.example/d.csv?X-Amz-Credential=${env:TRAINGATE_SECRET_4}"
                                   "&X-Amz-Signature=${env:TRAINGATE_SECRET_5}")
    assert tree["checkpoint"]["uri"] == "s3://u:${env:TRAINGATE_SECRET_6}@bucket/ckpt"
    assert redact_tree(tree) == tree  # nothing a redactor would mask is left
    assert original == _script_tree()  # the input is not modified
    parse_spec(tree)  # still a valid spec
    assert resolve_tree(tree, env=added) == original  # and the references give back exactly the original


def test_extract_reuses_the_name_the_environment_holds_for_the_same_value_and_skips_taken_names():
    env = {"TRAINGATE_SECRET_1": "other", "TRAINGATE_SECRET_2": "known-Secret"}
    tree, _, added = extract({"a": {"password": "known-Secret"}, "b": {"token": "new-Secret"},
                              "c": {"api_key": "new-Secret"}}, env=env)
    assert tree == {"a": {"password": "${env:TRAINGATE_SECRET_2}"}, "b": {"token": "${env:TRAINGATE_SECRET_3}"},
                    "c": {"api_key": "${env:TRAINGATE_SECRET_3}"}}
    assert added == {"TRAINGATE_SECRET_3": "new-Secret"}


def test_set_overrides_holding_secrets_are_rewritten_to_references_and_others_pass_verbatim():
    overrides = ["optim.lr=3e-4", "recipe.script.command=[python, t.py, --api-token, tok-Planted-7]",
                 "data.uri=https://u:pw-Planted-8@h/d.csv", "recipe.params.api_key=key-Planted-9"]
    _, new, added = extract({}, overrides, env={})
    assert new[0] == "optim.lr=3e-4"
    assert added == {"TRAINGATE_SECRET_1": "tok-Planted-7", "TRAINGATE_SECRET_2": "pw-Planted-8",
                     "TRAINGATE_SECRET_3": "key-Planted-9"}
    assert not any("Planted" in o for o in new)
    tree = apply_overrides({}, new)  # the spec parser reads the rewritten overrides back
    assert tree["recipe"]["script"]["command"] == ["python", "t.py", "--api-token", "${env:TRAINGATE_SECRET_1}"]
    assert tree["data"]["uri"] == "https://u:${env:TRAINGATE_SECRET_2}@h/d.csv"
    assert tree["recipe"]["params"]["api_key"] == "${env:TRAINGATE_SECRET_3}"
    assert resolve_tree(tree, env=added) == apply_overrides({}, overrides[1:]) | {"optim": {"lr": 3e-4}}


def test_a_malformed_override_is_refused_by_the_spec_parser_not_swallowed():
    with pytest.raises(SpecError, match="expected key=value"):
        extract({}, ["no-equals-sign"], env={})


def test_a_spec_with_references_validates_and_resolves_only_where_used(tmp_path):
    spec = load_spec_text("identity: {experiment: e, owner: o, team: t, purpose: p}\n"
                          "recipe: {name: digits-cnn}\n"
                          "data: {uri: 'https://h/d.csv?token=${env:TG_TEST_TOKEN}'}\n")
    assert spec.data.uri == "https://h/d.csv?token=${env:TG_TEST_TOKEN}"
    assert refs(spec.to_dict()) == ["TG_TEST_TOKEN"]
    env = {"TG_TEST_TOKEN": "abc", "TRAINGATE_ENV_ALLOW": "TG_TEST_*", "TRAINGATE_ENV_HOSTS": "h"}
    assert resolve(spec.data.uri, env=env) == "https://h/d.csv?token=abc"


def test_an_unset_reference_is_one_line_naming_the_field_the_variable_and_the_fix():
    tree = {"recipe": {"script": {"command": ["python", "t.py", "--api-token", "${env:TG_UNSET_VAR}"]}}}
    with pytest.raises(SecretRefError) as e:
        check_refs(tree, env={"TRAINGATE_ENV_ALLOW": "TG_UNSET_VAR"})
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, SpecError)
    assert msg.startswith("recipe.script.command[3] = '${env:TG_UNSET_VAR}': ")
    assert "TG_UNSET_VAR is not set" in msg and "export TG_UNSET_VAR" in msg


def test_an_unset_reference_error_does_not_echo_a_literal_secret_beside_it():
    with pytest.raises(SecretRefError) as e:
        resolve("https://u:pw-Planted-10@h/?sig=${env:TG_UNSET_VAR}", env={}, field="data.uri")
    assert "pw-Planted-10" not in str(e.value) and "TG_UNSET_VAR" in str(e.value)


def test_protect_moves_secrets_into_this_processes_environment_for_child_processes(monkeypatch):
    for k in [k for k in os.environ if k.startswith("TRAINGATE_SECRET_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("TRAINGATE_SECRET_1", "already-there")
    tree, overrides = protect({"recipe": {"params": {"api_token": "tok-Planted-11"}}}, ["x.password=pw-Planted-12"])
    try:
        assert tree == {"recipe": {"params": {"api_token": "${env:TRAINGATE_SECRET_2}"}}}
        assert overrides == ['x.password="${env:TRAINGATE_SECRET_3}"']
        assert os.environ["TRAINGATE_SECRET_2"] == "tok-Planted-11"
        assert os.environ["TRAINGATE_SECRET_3"] == "pw-Planted-12"
    finally:
        os.environ.pop("TRAINGATE_SECRET_2", None)
        os.environ.pop("TRAINGATE_SECRET_3", None)


def test_an_http_tracking_uri_gives_its_user_and_password_to_mlflows_credential_variables():
    env = {"TRAINGATE_TRACKING_URI": "https://ci%40corp:p%2Fw-Planted-13@mlflow.corp:8443/base",
           "MLFLOW_TRACKING_URI": "sqlite:////tmp/x.db"}
    move_tracking_credentials(env)
    assert env == {"TRAINGATE_TRACKING_URI": "https://mlflow.corp:8443/base", "MLFLOW_TRACKING_URI": "sqlite:////tmp/x.db",
                   "MLFLOW_TRACKING_USERNAME": "ci@corp", "MLFLOW_TRACKING_PASSWORD": "p/w-Planted-13"}


def test_credentials_given_twice_and_different_are_refused_in_one_line_without_the_password():
    env = {"TRAINGATE_TRACKING_URI": "http://u:pw-Planted-14@h:5000", "MLFLOW_TRACKING_PASSWORD": "other"}
    with pytest.raises(SpecError) as e:
        move_tracking_credentials(env)
    assert "pw-Planted-14" not in str(e.value) and "MLFLOW_TRACKING_PASSWORD" in str(e.value)
    assert env["TRAINGATE_TRACKING_URI"] == "http://u:pw-Planted-14@h:5000"  # nothing half-moved


def test_a_database_tracking_uri_keeps_its_password_for_the_driver():
    env = {"TRAINGATE_TRACKING_URI": "postgresql://u:pw@db:5432/mlflow"}
    move_tracking_credentials(env)
    assert env == {"TRAINGATE_TRACKING_URI": "postgresql://u:pw@db:5432/mlflow"}


def test_protect_spec_gives_a_valid_spec_holding_references(monkeypatch):
    for k in [k for k in os.environ if k.startswith("TRAINGATE_SECRET_")]:
        monkeypatch.delenv(k)
    tree = _script_tree()
    spec = parse_spec(tree)
    try:
        safe = protect_spec(spec)
        assert safe.recipe.script.command[-2:] == ["${env:TRAINGATE_SECRET_1}",
                                                  "--endpoint=https://svc/x?sig=${env:TRAINGATE_SECRET_2}"]
        assert "Planted" not in json.dumps(safe.to_dict())
        assert resolve_tree(safe.to_dict()) == spec.to_dict()
    finally:
        for n in range(1, 7):
            os.environ.pop(f"TRAINGATE_SECRET_{n}", None)


def test_stage_files_record_errors_and_results_with_secrets_masked(tmp_path):
    from traingate.job import files
    from traingate.job.vocab import Status

    files.write_last_words(tmp_path, files.LastWords(
        rank=0, cause="user_error", error="cannot open http://u:pw-Planted-15@h/x", time=1.0, exit_code=64,
        traceback="Traceback ...\nValueError: --api-token tok-Planted-16"))
    files.write_result(tmp_path, files.RuntimeResult(status=Status.COMPLETED, exit_code=0,
                                                      checkpoint_uri="s3://k:pw-Planted-17@b/ckpt"))
    files.write_supervisor_state(tmp_path, files.SupervisorState(
        attempts=[{"error": "password=pw-Planted-18", "overrides": ["optim.batch_size=8"]}]))
    written = "".join(p.read_text() for p in tmp_path.iterdir())
    assert "Planted" not in written
    words = files.read_last_words(tmp_path)[0]
    assert words.error == "cannot open http://u:***@h/x" and words.traceback.endswith("--api-token ***")
    assert files.read_result(tmp_path).status == Status.COMPLETED
    assert files.read_supervisor_state(tmp_path).attempts[0]["overrides"] == ["optim.batch_size=8"]


def test_cli_validate_prints_the_spec_as_run_records_it_with_references(tmp_path):
    import subprocess

    from tgtest import PYTHON

    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGATE_SECRET_")}
    env["TRAINGATE_STATE_DIR"] = str(tmp_path / "state")
    proc = subprocess.run([PYTHON, "-m", "flows.cli", "validate", str(ROOT / "examples" / "script.yaml"),
                           "--set", "recipe.script.command=[python, train.py, --api-token, tok-Planted-19]"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Planted" not in proc.stdout + proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["recipe"]["script"]["command"] == ["python", "train.py", "--api-token", "${env:TRAINGATE_SECRET_1}"]
    assert not (tmp_path / "state").exists()


def test_cli_spec_errors_reach_the_terminal_without_the_secret_they_quote(tmp_path):
    import subprocess

    from tgtest import PYTHON

    env = {**os.environ, "TRAINGATE_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.run([PYTHON, "-m", "flows.cli", "validate", str(ROOT / "examples" / "digits.yaml"),
                           "--set", "data.uri=https://u:pw-Planted-20@h/d.csv?sig=sig-Planted-21"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("traingate: invalid spec: data.uri")
    assert "Planted" not in proc.stdout + proc.stderr


# ---------------------------------------------------------------- the allowlist, and what validate sends
CHARGPT = (
    "identity: {experiment: e, owner: o, team: t, purpose: p}\n"
    "recipe: {name: char-gpt, params: {block_size: 8, n_layer: 1, n_head: 2, n_embd: 16}}\n"
)


def test_a_reference_to_a_variable_not_on_the_allowlist_is_refused_in_one_line_even_when_it_is_set(
    tmp_path, state_dir, monkeypatch, capsys
):
    from flows.cli import main

    monkeypatch.setenv("TG_WORKER_DB_PASSWORD", "pw-Planted-30")  # what a worker's environment holds
    monkeypatch.setenv("TRAINGATE_ENV_ALLOW", "HF_TOKEN")
    spec = tmp_path / "spec.yaml"
    spec.write_text(CHARGPT + "data: {uri: 'http://127.0.0.1:9/c.txt?k=${env:TG_WORKER_DB_PASSWORD}'}\n")
    assert main(["validate", str(spec)]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Planted" not in out + err, err
    assert err.startswith(
        "traingate: invalid spec: data.uri = 'http://127.0.0.1:9/c.txt?k=${env:TG_WORKER_DB_PASSWORD}"
        "': environment variable TG_WORKER_DB_PASSWORD is not on the allowlist TRAINGATE_ENV_ALLOW"
    )
    assert not state_dir.exists()


def test_an_allowed_reference_resolved_into_a_url_to_a_foreign_host_is_refused_naming_the_host():
    env = {"TG_TOKEN": "tok-Planted-31", "TRAINGATE_ENV_ALLOW": "TG_*"}
    with pytest.raises(SecretRefError) as e:
        resolve("https://collector.example/c?t=${env:TG_TOKEN}", env=env, field="alerts.webhook_url")
    assert "into a URL to collector.example" in str(e.value) and "TRAINGATE_ENV_HOSTS" in str(e.value)
    assert "Planted" not in str(e.value)
    # Loopback, an allowed host, the configured stores, and a local file are where a value may go.
    assert resolve("http://127.0.0.1:5/x?t=${env:TG_TOKEN}", env=env).endswith("tok-Planted-31")
    assert resolve(
        "https://collector.example/c?t=${env:TG_TOKEN}", env=env | {"TRAINGATE_ENV_HOSTS": "collector.example"}
    ).endswith("tok-Planted-31")
    assert resolve(
        "https://mlflow.corp/x?t=${env:TG_TOKEN}", env=env | {"TRAINGATE_TRACKING_URI": "https://mlflow.corp"}
    )
    assert resolve("file:///tmp/${env:TG_TOKEN}", env=env) == "file:///tmp/tok-Planted-31"
    # The spec's own literals, moved out by `traingate run`, go where the spec sent them.
    assert resolve("https://h/d?sig=${env:TRAINGATE_SECRET_1}", env={"TRAINGATE_SECRET_1": "s"}) == "https://h/d?sig=s"


def test_validate_opens_no_connection_for_remote_data_a_webhook_and_their_references(
    tmp_path, state_dir, monkeypatch, capsys
):
    import socket

    from flows.cli import main

    opened: list[str] = []

    def refuse(*args, **kwargs):
        opened.append(repr(args)[:200])
        raise AssertionError("validate opened a connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setenv("TG_DATA_TOKEN", "tok-Planted-32")
    monkeypatch.setenv("TG_HOOK", "https://hooks.example/hooks/hook-Planted-33")
    monkeypatch.setenv("TRAINGATE_ENV_ALLOW", "TG_DATA_TOKEN,TG_HOOK")
    monkeypatch.setenv("TRAINGATE_ENV_HOSTS", "data.example")
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        CHARGPT + "data: {uri: 'https://data.example/{latest}/c.txt?token=${env:TG_DATA_TOKEN}'}\n"
        "alerts: {webhook_url: '${env:TG_HOOK}'}\n"
    )
    assert main(["validate", str(spec)]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    assert opened == [] and "Planted" not in out + err
    assert yaml.safe_load(out)["data"]["uri"] == "https://data.example/{latest}/c.txt?token=${env:TG_DATA_TOKEN}"
    assert not state_dir.exists()


def test_a_pools_locations_carry_the_allowlist_and_hosts_but_never_the_checkpoint_key():
    from traingate.settings import pool_locations

    env = {"TRAINGATE_STATE_DIR": "/srv/tg", "TRAINGATE_ENV_ALLOW": "HF_TOKEN,WANDB_*",
           "TRAINGATE_ENV_HOSTS": "hooks.slack.com", "TRAINGATE_CHECKPOINT_KEY": "k-Planted-34" * 4}
    assert pool_locations("gpu-a100", env) == {"TRAINGATE_STATE_DIR": "/srv/tg", "TRAINGATE_ENV_ALLOW": "HF_TOKEN,WANDB_*",
                                               "TRAINGATE_ENV_HOSTS": "hooks.slack.com"}


def test_threads_of_one_process_generating_the_checkpoint_key_at_once_all_read_the_same_key(tmp_path):
    import threading

    from traingate.settings import Settings, checkpoint_key

    for attempt in range(5):  # a sweep's trials start in threads of one process
        settings = Settings.from_env({"TRAINGATE_STATE_DIR": str(tmp_path / f"state{attempt}")})
        start, keys, errors = threading.Barrier(8), [], []

        def first_run() -> None:
            start.wait()
            try:
                keys.append(checkpoint_key(settings, env={}))
            except Exception as e:  # noqa: BLE001 - what the test reports
                errors.append(repr(e))

        threads = [threading.Thread(target=first_run) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and len(set(keys)) == 1 and len(keys) == 8
        assert sorted(p.name for p in (tmp_path / f"state{attempt}").iterdir()) == ["checkpoint.key"]


def test_the_checkpoint_key_is_generated_once_into_the_state_dir_readable_by_its_owner_only(tmp_path):
    from traingate.settings import Settings, checkpoint_key

    settings = Settings.from_env({"TRAINGATE_STATE_DIR": str(tmp_path / "state")})
    key = checkpoint_key(settings, env={})
    assert len(key) == 64 and checkpoint_key(settings, env={}) == key
    assert (tmp_path / "state" / "checkpoint.key").stat().st_mode & 0o777 == 0o600
    assert checkpoint_key(settings, env={"TRAINGATE_CHECKPOINT_KEY": "x" * 40}) == b"x" * 40
    with pytest.raises(ValueError, match="TRAINGATE_CHECKPOINT_KEY holds 8 characters: too short"):
        checkpoint_key(settings, env={"TRAINGATE_CHECKPOINT_KEY": "k-Plante"})
