"""flows.logsafety: what Prefect stores and shows of a run's logs and prints holds no secret."""
from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

from flows import logsafety
from tgtest import PYTHON, ROOT

PW = "pw-Canary-31f7"
TOKEN = "tok-Canary-8e2a"
ENV_SECRET = "env-Canary-55c1d"
# What the leaky flow's five log lines hold once masked; the test reads the server's logs until all are there.
MASKED = ("http://alice:***@127.0.0.1:5000", "env secret *** and password=***",
          "RuntimeError: cannot reach s3://k:***@bucket", "task prints --api-token ***", "X-Amz-Signature=***")


@pytest.fixture
def installed(monkeypatch):
    """logsafety.install() for one test, with the process's logging and hooks restored afterwards."""
    saved = (logging.getLogRecordFactory(), warnings.formatwarning, sys.excepthook, threading.excepthook,
             sys.stdout, sys.stderr)
    monkeypatch.setenv("TRAINGATE_SECRET_1", ENV_SECRET)
    logsafety.install()
    yield
    sys.stdout.flush()
    sys.stderr.flush()
    logging.setLogRecordFactory(saved[0])
    warnings.formatwarning, sys.excepthook, threading.excepthook, sys.stdout, sys.stderr = saved[1:]
    for handler in logsafety._all_handlers():
        handler.removeFilter(logsafety._FILTER)


def _leaky_flow():
    from prefect import flow, get_run_logger, task

    @task(log_prints=True)
    def leaky_task() -> None:
        print(f"task prints --api-token {TOKEN}")
        get_run_logger().warning("task logs %s", f"https://d/x?X-Amz-Signature={TOKEN}")

    @flow(log_prints=True)
    def leaky() -> None:
        print(f"View run r at: http://alice:{PW}@127.0.0.1:5000/#/experiments/1")
        get_run_logger().info("env secret %s and password=%s", ENV_SECRET, PW)
        try:
            raise RuntimeError(f"cannot reach s3://k:{PW}@bucket")
        except RuntimeError:
            get_run_logger().exception("with a traceback")
        leaky_task()

    return leaky


def _run_logs(flow_run_id) -> list[str]:
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        deadline = time.monotonic() + 30  # the API log handler ships batches in the background
        while True:
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            messages = [log.message for log in logs]
            stored = "\n".join(messages)
            if all(line in stored for line in MASKED) or time.monotonic() > deadline:
                return messages
            time.sleep(0.5)


@pytest.fixture
def run_loggers_at_info():
    """The test session logs Prefect at WARNING; prints are INFO records. (Call after importing
    prefect.flows: importing it reconfigures logging.)"""
    loggers = [logging.getLogger(n) for n in ("prefect.flow_runs", "prefect.task_runs")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.INFO)
    yield
    for lg, level in zip(loggers, levels):
        lg.setLevel(level)


def test_prefect_api_logs_and_log_prints_of_flows_and_tasks_are_stored_redacted(prefect_harness, installed, capfd,
                                                                                request):
    leaky = _leaky_flow()
    request.getfixturevalue("run_loggers_at_info")
    state = leaky(return_state=True)
    assert state.is_completed(), state.message
    messages = _run_logs(state.state_details.flow_run_id)
    stored = "\n".join(messages)
    for secret in (PW, TOKEN, ENV_SECRET):
        assert secret not in stored
    for line in MASKED:
        assert line in stored  # the lines arrived, masked
    terminal = capfd.readouterr()
    assert not any(s in terminal.out + terminal.err for s in (PW, TOKEN, ENV_SECRET))


def test_direct_writes_warnings_and_uncaught_exceptions_reach_the_terminal_redacted():
    code = textwrap.dedent(f"""
        import sys, threading, warnings
        from flows import logsafety
        logsafety.install()
        sys.stdout.write("View run r at: http://alice:{PW}@127.0.0.1:5000/#/x\\n")
        sys.stdout.write("split over writes http://alice:{PW[:5]}")
        sys.stdout.write("{PW[5:]}@h and no newline before exit")
        warnings.warn("tracking uri http://u:{PW}@h has no TLS")
        def leak():
            raise KeyError("--password {PW}")
        t = threading.Thread(target=leak, name="leaker")
        t.start()
        t.join()
        raise ValueError("bad token={TOKEN}")
    """)
    proc = subprocess.run([PYTHON, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1  # the uncaught exception still ends the process as an error
    assert PW not in proc.stderr and TOKEN not in proc.stderr
    assert proc.stdout == ("View run r at: http://alice:***@127.0.0.1:5000/#/x\n"
                           "split over writes http://alice:***@h and no newline before exit")
    assert "http://u:***@h has no TLS" in proc.stderr
    assert "Exception in thread leaker" in proc.stderr and "KeyError: '--password ***'" in proc.stderr
    assert "ValueError: bad token=***" in proc.stderr
