"""traingate.redact: every shape a secret takes in text, trees and log records is masked; nothing else is."""
from __future__ import annotations

import doctest
import io
import logging

import pytest

import traingate.redact as redact_module
from traingate.redact import (RedactingFilter, install_log_redaction, redact, redact_mapping, redact_tree,
                              secret_spans)

SECRET = "Zq9-canary-7Hx2"


def test_module_doctests_pass():
    assert doctest.testmod(redact_module).failed == 0


@pytest.mark.parametrize("text, masked", [
    ("http://alice:PW@127.0.0.1:5000/#/experiments/1", "http://alice:***@127.0.0.1:5000/#/experiments/1"),
    ("View run r at: https://u:PW@mlflow.example/#/x", "View run r at: https://u:***@mlflow.example/#/x"),
    ("mlflow ui --backend-store-uri postgresql://u:PW/with/slash@db:5432/m",
     "mlflow ui --backend-store-uri postgresql://u:***@db:5432/m"),
    ("https://ghp_0123456789abcdefghijAB@github.com/o/r", "https://***@github.com/o/r"),
    ("password=PW&sslmode=require", "password=***&sslmode=require"),
    ("client_secret: PW", "client_secret: ***"),
    ('{"api_key": "P W", "lr": 0.1}', '{"api_key": "***", "lr": 0.1}'),
    ("{'aws_secret_access_key': 'PW'}", "{'aws_secret_access_key': '***'}"),
    ("python train.py --api-token PW --lr 0.1", "python train.py --api-token *** --lr 0.1"),
    ("python train.py --password=PW", "python train.py --password=***"),
    ("['python', 'train.py', '--api-token', 'PW']", "['python', 'train.py', '--api-token', '***']"),
    ("[--secret, PW]", "[--secret, ***]"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4&X-Amz-Credential=AKIAX%2F1%2Fus&X-Amz-Signature=PW",
     "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4&X-Amz-Credential=***&X-Amz-Signature=***"),
    ("https://b/k?X-Amz-Security-Token=PW&x=1", "https://b/k?X-Amz-Security-Token=***&x=1"),
    ("https://a.blob.core.windows.net/c?sv=2020-08&sig=PW%2B&se=2030", "https://a.blob.core.windows.net/c?sv=2020-08&sig=***&se=2030"),
    ("https://d.cloudfront.net/f?Expires=1&Signature=PW&Key-Pair-Id=K", "https://d.cloudfront.net/f?Expires=1&Signature=***&Key-Pair-Id=K"),
    ("https://storage.googleapis.com/b/o?X-Goog-Credential=PW&X-Goog-Signature=PW2",
     "https://storage.googleapis.com/b/o?X-Goog-Credential=***&X-Goog-Signature=***"),
    ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.PW", "Authorization: Bearer ***"),
    ("Authorization: Basic dXNlcjpwYXNz", "Authorization: Basic ***"),
    ("sent with bearer abcdefgh12345678", "sent with bearer ***"),
    ("key id AKIAIOSFODNN7EXAMPLE in a message", "key id *** in a message"),
])
def test_every_secret_shape_is_masked(text, masked):
    assert redact(text) == masked


@pytest.mark.parametrize("text", [
    "tokenizer: gpt2, max_tokens=5, --token-file /etc/tok, n_tokens: 9",
    "postgresql://db:5432/m?sslmode=require",
    "s3://bucket/checkpoints/run/step_5",
    "password=${env:TRAINGATE_SECRET_1} http://u:${env:PW}@h --api-token ${env:TOKEN}",
    "the basic idea; a bearer of news",
])
def test_ordinary_text_and_secret_references_are_left_alone(text):
    assert redact(text) == text


def test_values_of_secret_environment_variables_are_masked_wherever_they_appear(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalr/XUtnFEMI+K7MDENG")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "mlflow-token-123")
    monkeypatch.setenv("PREFECT_API_KEY", "pnu_abcdefgh")
    monkeypatch.setenv("TRAINGATE_SECRET_3", "spec-secret-9")
    monkeypatch.setenv("MY_SERVICE_KEY", "service-key-77")
    text = ("a wJalr/XUtnFEMI+K7MDENG b wJalr%2FXUtnFEMI%2BK7MDENG c mlflow-token-123 d pnu_abcdefgh "
            "e spec-secret-9 f service-key-77")
    assert redact(text) == "a *** b *** c *** d *** e *** f ***"


def test_a_secret_variable_set_changed_or_registered_after_a_redaction_is_masked_from_then_on(monkeypatch):
    # The environment's secrets are read once and read again when the environment or the registered values change.
    assert redact("token first-value-1234 and second-value-5678") == "token first-value-1234 and second-value-5678"
    monkeypatch.setenv("MY_API_TOKEN", "first-value-1234")
    assert redact("token first-value-1234 and second-value-5678") == "token *** and second-value-5678"
    monkeypatch.setenv("MY_API_TOKEN", "second-value-5678")
    assert redact("token first-value-1234 and second-value-5678") == "token first-value-1234 and ***"
    monkeypatch.delenv("MY_API_TOKEN")
    assert redact("token first-value-1234 and second-value-5678") == "token first-value-1234 and second-value-5678"
    monkeypatch.setattr(redact_module, "_REGISTERED", set())
    redact_module.register_secret("registered-value-42")
    assert redact("a registered-value-42 b") == "a *** b"


def test_short_values_of_secret_variables_are_masked_as_whole_words_only(monkeypatch):
    monkeypatch.setenv("TRAINGATE_SECRET_1", "hunt")
    assert redact("pw hunt; hunter; a-hunt-b") == "pw ***; hunter; a-***-b"


def test_non_secret_aws_settings_and_short_named_values_stay_visible(monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-central-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    text = "region eu-central-1 at http://127.0.0.1:9000, parallelism false"
    assert redact(text) == text


def test_trees_mask_secret_keys_flag_values_and_strings_inside_lists_and_tuples():
    tree = {
        "recipe": {"params": {"api_token": "T", "tokenizer": "gpt2", "n": 3},
                   "script": {"command": ["python", "t.py", "--api-token", "T", "--lr", "0.1"],
                              "stage_args": {"smoke": ["--password", "P", "--steps", "5"]}}},
        "data": {"uri": "https://h/d?sig=S&v=1"},
        "creds": {"password": 12345678, "user": "u"},
        "client_secret": {"nested": ["a", "b"]},
        "argv": ("--secret", "S", "--flag=1"),
        "ref": {"token": "${env:TOKEN}"},
        "flags": [True, None, 1.5],
    }
    assert redact_tree(tree) == {
        "recipe": {"params": {"api_token": "***", "tokenizer": "gpt2", "n": 3},
                   "script": {"command": ["python", "t.py", "--api-token", "***", "--lr", "0.1"],
                              "stage_args": {"smoke": ["--password", "***", "--steps", "5"]}}},
        "data": {"uri": "https://h/d?sig=***&v=1"},
        "creds": {"password": "***", "user": "u"},
        "client_secret": {"nested": ["***", "***"]},
        "argv": ("--secret", "***", "--flag=1"),
        "ref": {"token": "${env:TOKEN}"},
        "flags": [True, None, 1.5],
    }
    assert redact_mapping({"pw": "x", "password": "y"}) == {"pw": "x", "password": "***"}


def test_spans_are_merged_where_two_detectors_overlap(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "overlapping-secret-value")
    text = "password=overlapping-secret-value"
    assert secret_spans(text) == [(9, len(text))]
    assert redact(text) == "password=***"


def _capture(handler_filter: bool) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    if handler_filter:
        handler.addFilter(RedactingFilter())
    logger = logging.getLogger(f"test-redact-{handler_filter}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, stream


def test_a_handler_filter_masks_messages_arguments_and_tracebacks():
    logger, stream = _capture(handler_filter=True)
    logger.info("connect %s with %r", "http://u:" + SECRET + "@h", {"password": SECRET})
    try:
        raise RuntimeError(f"cannot open s3://k:{SECRET}@bucket/x")
    except RuntimeError:
        logger.exception("failed: --api-token %s", SECRET)
    out = stream.getvalue()
    assert SECRET not in out
    assert "http://u:***@h" in out and "'password': '***'" in out and "RuntimeError: cannot open s3://k:***@bucket/x" in out


@pytest.fixture
def restore_record_factory():
    factory = logging.getLogRecordFactory()
    yield
    logging.setLogRecordFactory(factory)


def test_the_record_factory_masks_records_for_every_handler_even_unfiltered_ones(restore_record_factory):
    install_log_redaction()
    wrapped = logging.getLogRecordFactory()
    install_log_redaction()
    assert logging.getLogRecordFactory() is wrapped  # idempotent: one wrapper, not two
    logger, stream = _capture(handler_filter=False)
    logger.info("token: %s", SECRET)
    logger.warning("ok %d steps", 3)
    try:
        raise ValueError(f"Bearer {SECRET}abcdefgh")
    except ValueError:
        logger.error("boom", exc_info=True)
    out = stream.getvalue()
    assert SECRET not in out
    assert "token: ***" in out and "ok 3 steps" in out and "ValueError: Bearer ***" in out


def test_a_malformed_logging_call_does_not_leak_its_arguments(restore_record_factory, capsys):
    install_log_redaction()
    logger, stream = _capture(handler_filter=False)
    logger.info("two %s %s", "password=" + SECRET)  # one argument short: logging reports the call
    assert SECRET not in stream.getvalue() + capsys.readouterr().err


@pytest.mark.parametrize("text, secret", [
    ("python t.py --wandb-key wk-Planted-40 --lr 0.1", "wk-Planted-40"),
    ("python t.py --db-pass=dp-Planted-41", "dp-Planted-41"),
    ("['train.py', '--pw', 'pw-Planted-42']", "pw-Planted-42"),
    ("https://hooks.slack.com/services/T0001/B0001/sl-Planted-43", "sl-Planted-43"),
    ("POST https://discord.com/api/webhooks/1234/dc-Planted-44 failed", "dc-Planted-44"),
    ("http://127.0.0.1:8080/ci/hooks/gh-Planted-45?x=1", "gh-Planted-45"),
    ("https://b.example/k?X-Amz-Signature=as-Planted-46&token=tk-Planted-47", "as-Planted-46"),
    ("https://b.example/k?X-Amz-Signature=as-Planted-46&token=tk-Planted-47", "tk-Planted-47"),
    ("https://ui:ui-Planted-48@prefect.example/api", "ui-Planted-48"),
])
def test_each_class_of_secret_is_masked_in_free_text(text, secret):
    assert secret not in redact(text)


def test_settings_named_like_flags_or_paths_are_not_masked(monkeypatch):
    monkeypatch.setenv("PWD", "/work/project-dir")
    monkeypatch.setenv("SSH_KEY_PATH", "/home/u/.ssh/id_ed25519")
    assert redact("cwd /work/project-dir, key at /home/u/.ssh/id_ed25519") == (
        "cwd /work/project-dir, key at /home/u/.ssh/id_ed25519")
    assert redact("train.py --passes 3 --keep-last 2") == "train.py --passes 3 --keep-last 2"


def test_the_values_of_secret_block_variables_and_registered_secrets_are_masked_whatever_their_names(monkeypatch):
    from traingate.redact import register_secret

    monkeypatch.setenv("TRAINGATE_SECRET_BLOCKS", "DATABASE_DSN=tg-db")
    monkeypatch.setenv("DATABASE_DSN", "dsn-Planted-49")
    register_secret("gen-Planted-50")
    assert redact("dsn dsn-Planted-49 and gen-Planted-50") == "dsn *** and ***"


def test_helper_sockets_and_programs_named_like_secrets_are_not_masked(monkeypatch):
    monkeypatch.setenv("SSH_AUTH_SOCK", "/tmp/ssh-agent-dir/agent.42")
    monkeypatch.setenv("GIT_ASKPASS", "/usr/lib/git-core/askpass-helper")
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "admin:auth-Planted-51")
    assert redact("agent /tmp/ssh-agent-dir/agent.42 via /usr/lib/git-core/askpass-helper, admin:auth-Planted-51"
                  ) == "agent /tmp/ssh-agent-dir/agent.42 via /usr/lib/git-core/askpass-helper, ***"
