"""The local Prefect server traingate keeps (flows.local_server, `traingate server`): real `prefect server start`
processes on loopback, real CLI subprocesses, a real Prefect client."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import stat
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from tgtest import PYTHON, ROOT, describe, run_processes

from flows import cli_engine, cli_forward, local_server


def _env(state: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update({"TRAINGATE_STATE_DIR": str(state), "TRAINGATE_PREFECT_SERVER": "kept", **extra})
    return env


def _cli(state: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "flows.cli", *args], cwd=ROOT, env=_env(state, **extra),
                          capture_output=True, text=True, timeout=400)


def _status(url: str, auth: str | None = None, body: bytes | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


# A client the way run, resume, sweep and retrain are one: connect() before Prefect is imported, then
# Prefect's own client (auth string and CSRF token) reads the server.
CLIENT = """
import json, os, sys
from pathlib import Path
from flows import local_server
record = local_server.connect(Path(sys.argv[1]))
from prefect import get_client
with get_client(sync_client=True) as c:
    flows = c.read_flows()
print(json.dumps({"pid": record.pid, "url": os.environ["PREFECT_API_URL"], "flows": len(flows)}))
"""


@pytest.mark.slow  # two real Prefect server starts (10-20 s each on a loaded 2-core box)
def test_two_commands_at_once_share_one_kept_server_later_commands_reuse_it_forked_from_its_engine_and_stop_leaves_no_process(
        tmp_path):
    state = tmp_path / "state"
    starts = [subprocess.Popen([PYTHON, "-m", "flows.cli", "server", "start"], cwd=ROOT, env=_env(state),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=400) for p in starts]
    assert [p.returncode for p in starts] == [0, 0], outs
    lines = sorted(o for o, _ in outs)
    assert lines[0].startswith("already running: ") and lines[1].startswith("started: "), lines
    d = local_server.server_dir(state)
    record = local_server.Record(**json.loads((d / local_server.RECORD).read_text()))
    assert all(f"pid {record.pid}," in o and record.api_url in o for o in lines)
    try:
        # A later command reuses it: same URL, same pid, and Prefect's client works through the auth string.
        later = subprocess.run([PYTHON, "-c", CLIENT, str(state)], cwd=ROOT, env=_env(state), capture_output=True,
                               text=True, timeout=300)
        assert later.returncode == 0, later.stderr[-3000:]
        seen = json.loads(later.stdout.strip().splitlines()[-1])
        assert (seen["pid"], seen["url"]) == (record.pid, record.api_url)
        assert "started a local Prefect server" not in later.stderr

        # Authenticated as the stack's server is: anonymous and wrong credentials are refused on the API.
        auth = dict(line.split("=", 1) for line in (d / local_server.SECRETS).read_text().splitlines())[
            local_server.AUTH_VAR]
        assert _status(f"{record.api_url}/health") == 200
        assert _status(f"{record.api_url}/admin/version") == 401
        assert _status(f"{record.api_url}/flows/filter", body=b"{}") in (401, 403)
        assert _status(f"{record.api_url}/admin/version", auth="traingate:wrong") == 401
        assert _status(f"{record.api_url}/admin/version", auth=auth) == 200
        listening = [c.laddr for c in psutil.Process(record.pid).net_connections() if c.status == "LISTEN"]
        assert [(a.ip, a.port) for a in listening] == [("127.0.0.1", record.port)]

        # Its secrets and database are the user's alone, and no command printed the auth string.
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        for name in (local_server.SECRETS, "prefect.db", local_server.RECORD, local_server.LOG):
            assert stat.S_IMODE((d / name).stat().st_mode) == 0o600, name
        status = _cli(state, "server", "status")
        assert status.returncode == 0 and f"pid {record.pid}," in status.stdout, status
        assert not any(auth.split(":")[1] in text for text in [*lines, later.stdout, later.stderr, status.stdout])

        engine = _commands_are_forked_from_the_servers_engine(state, record, tmp_path)

        # A crashed server (SIGKILL) leaves a stale record: the next command replaces it with a new server. The
        # engine ends with the server it served.
        os.kill(record.pid, signal.SIGKILL)
        again, started = local_server.ensure(state)
        assert started and again.pid != record.pid
        assert not local_server.alive_in_group(record.pgid)
        assert _gone([engine], 30), describe([psutil.Process(engine)])
        assert not (d / cli_engine.RECORD).exists()
        record = again
        # A cold command on the new server leaves an engine for it, which `server stop` ends.
        cold = _cli(state, "run", str(SPEC2), "--until", "unit", "--set", DATA)
        assert cold.returncode == 0, cold.stdout[-3000:] + cold.stderr[-3000:]
        engine = _engine_ready(d)["pid"]
    finally:
        stopped = _cli(state, "server", "stop")
    assert stopped.returncode == 0 and stopped.stdout.strip() == f"stopped (pid {record.pid})", stopped
    assert not local_server.alive_in_group(record.pgid)
    assert _gone([engine], 30), describe([psutil.Process(engine)])
    assert not (d / local_server.RECORD).exists() and not (d / cli_engine.RECORD).exists()
    assert _cli(state, "server", "status").returncode == 1


SPEC2 = ROOT / "examples" / "script_project2" / "spec.yaml"
DATA = f"data.uri={(ROOT / 'examples' / 'script_project2' / 'data.csv').as_uri()}"
# The same script, slowed so that a stage can be interrupted while it trains.
SLOW = 'recipe.script.command=[python, train.py, --ckpt-dir, "${TRAINGATE_CHECKPOINT_DIR}", --sleep, "0.05"]'


def _engine_log(d: Path) -> str:
    return (d / cli_engine.LOG).read_text() if (d / cli_engine.LOG).exists() else ""


def _engine_ready(d: Path) -> dict:
    deadline = time.monotonic() + 120
    while True:
        record = cli_forward.read_record(d)
        if record is not None and f"ready on {record['socket']}" in _engine_log(d):
            return record
        assert time.monotonic() < deadline, (_engine_log(d), record, sorted(os.listdir(d)))
        time.sleep(0.2)


def _gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _interrupted(state: Path, out: Path, sig: int) -> tuple[int, str, str]:
    """`traingate run` of the slowed script to its canary, sent ``sig`` (to its process group, as a terminal's
    Ctrl-C is) once the canary trains: its exit status, output and run id."""
    before = set((state / "runs").glob("*/canary"))
    with open(out, "w") as f:
        cli = subprocess.Popen([PYTHON, "-m", "flows.cli", "run", str(SPEC2), "--until", "canary", "--set", DATA,
                                "--set", SLOW], cwd=ROOT, env=_env(state), stdout=f, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "canary running" not in out.read_text():
            assert cli.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.1)
        os.killpg(cli.pid, sig)
        code = cli.wait(180)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    [canary] = set((state / "runs").glob("*/canary")) - before
    return code, out.read_text(), canary.parent.name


def _commands_are_forked_from_the_servers_engine(state: Path, record: local_server.Record, tmp_path: Path) -> int:
    """`traingate run` and `resume` on the kept server: the first one cold, which leaves the server an engine; later
    ones forked from it, with a cold command's output, exit status, Ctrl-C and death; one whose interpreter
    settings differ from the engine's runs cold. Returns the engine's pid."""
    d = local_server.server_dir(state)
    first = _cli(state, "run", str(SPEC2), "--until", "smoke", "--set", DATA)
    assert first.returncode == 0 and "pipeline PASSED" in first.stdout, first.stdout[-3000:] + first.stderr[-3000:]
    engine = _engine_ready(d)
    assert engine["server_pid"] == record.pid
    # The command's guardian, which stops what an ended command left behind, leaves the engine alone.
    time.sleep(1.5)
    assert psutil.pid_exists(engine["pid"]) and "ending" not in _engine_log(d), _engine_log(d)
    assert stat.S_IMODE(os.stat(os.path.dirname(engine["socket"])).st_mode) == 0o700
    assert stat.S_IMODE((d / cli_engine.RECORD).stat().st_mode) == 0o600

    # Ctrl-C reaches the forked command: the running stage is preempted and the run stops resumable.
    code, text, run_id = _interrupted(state, tmp_path / "int.out", signal.SIGINT)
    assert code == 1 and "Traceback" not in text, text[-4000:]
    # The script does not checkpoint on SIGTERM: the stop says its emergency checkpoint was not confirmed.
    assert (f"pipeline STOPPED: canary preempted, its emergency checkpoint not confirmed (it resumes from its latest "
            f"checkpoint); continue with: traingate resume {run_id}") in text
    forked = [int(p) for p in re.findall(r"forked (\d+) for `traingate run`", _engine_log(d))]
    assert len(forked) == 1, _engine_log(d)

    # A SIGKILLed `traingate` takes its forked command with it, and that command's training processes; the run
    # resumes, forked too.
    code, text, killed = _interrupted(state, tmp_path / "kill.out", signal.SIGKILL)
    forked = [int(p) for p in re.findall(r"forked (\d+) for `traingate run`", _engine_log(d))]
    assert code == -signal.SIGKILL and len(forked) == 2, _engine_log(d)
    assert _gone(forked, 30), describe([psutil.Process(p) for p in forked if psutil.pid_exists(p)])
    deadline = time.monotonic() + 60
    while left := run_processes(killed, str(state)):
        assert time.monotonic() < deadline, describe(left)
        time.sleep(0.2)
    resumed = _cli(state, "resume", killed, "--until", "canary")
    assert resumed.returncode == 0 and "resume PASSED" in resumed.stdout, resumed.stdout[-3000:] + resumed.stderr
    assert "for `traingate resume`" in _engine_log(d)

    # An interpreter setting (read at interpreter start) the engine does not share: the command runs cold.
    cold = _cli(state, "run", str(SPEC2), "--dry-run", PYTHONHASHSEED="7")
    assert cold.returncode == 0 and "plan for 'script-resume-demo'" in cold.stdout, cold.stderr[-3000:]
    assert "a command runs cold: the command's ['PYTHONHASHSEED'] differ" in _engine_log(d)
    assert len(re.findall(r"forked \d+ for", _engine_log(d))) == 3
    return engine["pid"]


def test_a_record_of_a_live_process_that_is_not_the_server_is_stale_and_that_process_is_left_alone(tmp_path):
    d = local_server.server_dir(tmp_path)
    d.mkdir(parents=True)
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        start = psutil.Process(bystander.pid).create_time()
        (d / local_server.RECORD).write_text(json.dumps(
            {"pid": bystander.pid, "pgid": bystander.pid, "port": 9, "started_at": start}))
        # Its pid and start time match but it does not answer as a Prefect server with our auth string.
        assert local_server.status(tmp_path) is None
        assert not (d / local_server.RECORD).exists()
        time.sleep(0.2)
        assert bystander.poll() is None, "a process that is not a Prefect server was signalled"
    finally:
        bystander.kill()
        bystander.wait()


def test_an_explicit_prefect_api_url_or_the_temporary_setting_starts_no_kept_server(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    monkeypatch.setenv("TRAINGATE_PREFECT_SERVER", "kept")
    assert local_server.connect(tmp_path) is None
    monkeypatch.delenv("PREFECT_API_URL")
    monkeypatch.setenv("TRAINGATE_PREFECT_SERVER", "temporary")
    assert local_server.connect(tmp_path) is None
    monkeypatch.delenv("TRAINGATE_PREFECT_SERVER")
    monkeypatch.setenv("CI", "true")  # CI's default: a temporary server per command
    assert local_server.connect(tmp_path) is None
    assert not local_server.server_dir(tmp_path).exists()


def test_a_bad_server_setting_is_refused_in_one_line_naming_the_variable_and_the_fix(tmp_path):
    p = _cli(tmp_path / "state", "resume", "0123abcd", TRAINGATE_PREFECT_SERVER="forever")
    assert p.returncode == 2
    assert p.stderr.strip() == (
        "traingate: TRAINGATE_PREFECT_SERVER = 'forever': not a server mode; use one of ['kept', 'temporary'] "
        "(or set PREFECT_API_URL to use a server of your own)"
    )
    assert not local_server.server_dir(tmp_path / "state").exists()


def test_a_forked_command_reads_prefects_settings_and_sets_up_its_logging_again_only_when_their_inputs_differ(
    monkeypatch, tmp_path
):
    import prefect.context
    import prefect.logging.configuration

    refresh = prefect.context.refresh_global_settings_context
    read: list[bool] = []
    configured: list[int] = []
    monkeypatch.setattr(prefect.context, "refresh_global_settings_context", lambda: read.append(True))
    monkeypatch.setattr(prefect.logging.configuration, "setup_logging", lambda incremental=None: configured.append(1))
    monkeypatch.chdir(tmp_path)  # a working directory without Prefect's files, as the engine's is here
    monkeypatch.setattr(local_server, "_SETTINGS_READ_FROM", None)
    monkeypatch.setattr(local_server, "_LOGGING_SET_UP_FROM", None)

    def again() -> tuple[int, int]:
        local_server._read_prefect_settings_again()
        return len(read), len(configured)

    assert again() == (1, 1)  # nothing noted (a cold process): both again
    local_server.note_prefect_setup()  # as the engine notes it after importing Prefect
    assert again() == (1, 1)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # a setting logging is not made from
    assert again() == (2, 1)
    # Files Prefect reads in the working directory: only what could set a setting counts.
    local_server.note_prefect_setup()
    (tmp_path / ".env").write_text("OTHER=1\n")
    (tmp_path / "pyproject.toml").write_text("[tool.black]\nline-length = 100\n")
    assert again() == (2, 1)
    for name, text in [
        (".env", "OTHER=1\nPREFECT_API_URL=http://127.0.0.1:8/api\n"),
        ("pyproject.toml", "[tool.prefect]\napi.url = 'http://127.0.0.1:7/api'\n"),
        ("prefect.toml", "[api]\nurl = 'http://127.0.0.1:6/api'\n"),
    ]:
        local_server.note_prefect_setup()
        (tmp_path / name).write_text(text)
        assert again()[0] == 3 + [".env", "pyproject.toml", "prefect.toml"].index(name), name
    # a logging setting, and an override of one value of the logging configuration file: both again
    logging_inputs = [("PREFECT_LOGGING_LEVEL", "DEBUG"), ("PREFECT_LOGGING_HANDLERS_API_LEVEL", "ERROR")]
    for n, (var, value) in enumerate(logging_inputs):
        local_server.note_prefect_setup()
        monkeypatch.setenv(var, value)
        assert again() == (6 + n, 2 + n), var
    monkeypatch.undo()
    refresh()
