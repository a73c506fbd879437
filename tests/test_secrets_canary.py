"""The secrets canary: plant unique secrets everywhere a user puts them, climb two full ladders
through the real `traingate run`, then read EVERY byte that was written and find none of them.

Planted, one of each class the redactor knows: secret environment variables (AWS_*, *_TOKEN, and
DB_PASS, named only tersely), the value of a variable TRAINGATE_SECRET_BLOCKS names (what a Prefect
Secret block fills in, whatever the variable is called), the MLflow tracking URI's user:password (a
real `mlflow server` on loopback), the temporary Prefect server's auth string, values after secret flags in the spec file (`--api-token VALUE`,
`--wandb-key VALUE`), `--set` values, a presigned-style data URI query string (served on loopback), a
literal webhook URL (`.../hooks/TOKEN`) in the spec, and a script that prints all of them on its stdout. Scanned: the whole test directory (state dir with Prefect's and
MLflow's SQLite databases read raw, MLflow artifacts, stage files and logs, TMPDIR of the run,
the MLflow server's log) and the captured terminal output.
"""
from __future__ import annotations

import hashlib
import http.server
import os
import secrets
import shutil
import subprocess
import threading
from functools import partial
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from tgtest import PYTHON, ROOT, TINY_DIGITS, free_port, wait_healthy

pytestmark = pytest.mark.slow


def _plant(kind: str) -> str:
    return f"cnry{kind}{secrets.token_hex(8)}"


PLANTED = {name: _plant(name) for name in (
    "AwsSecret", "ServiceToken", "TrackingPw", "ScriptToken", "SetPassword", "SetPurpose", "DataSig", "DataCred",
    "WandbKey", "DbPass", "BlockValue", "HookToken", "PrefectAuth")}
# The environment a worker would have: a tersely named password and a Secret block's variable.
PLANTED_ENV = {"DB_PASS": PLANTED["DbPass"], "DATABASE_DSN": PLANTED["BlockValue"],
               "TRAINGATE_SECRET_BLOCKS": "DATABASE_DSN=traingate-database-dsn"}

CANARY_SCRIPT = '''\
"""Wraps the example's train.py: shows every secret it was given on stdout, as careless scripts do."""
import hashlib, os, runpy, sys

args = sys.argv[1:]


def take(flag):
    if flag not in args:
        return None
    i = args.index(flag)
    value = args[i + 1]
    del args[i:i + 2]
    return value


token, password, wandb = take("--api-token"), take("--password"), take("--wandb-key")
print(f"canary: --api-token {token} --password {password} --wandb-key {wandb}", flush=True)
for var in ("AWS_SECRET_ACCESS_KEY", "MY_SERVICE_TOKEN", "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_PASSWORD",
            "DB_PASS", "DATABASE_DSN", "PREFECT_API_AUTH_STRING"):
    print(f"canary: {var}={os.environ.get(var)}", flush=True)
if hashlib.sha256((token or "").encode()).hexdigest() != EXPECTED_TOKEN_SHA256:
    print("canary: --api-token did not arrive resolved", flush=True)
    sys.exit(3)
sys.argv = ["train.py", *args]
runpy.run_path("train.py", run_name="__main__")
'''


class _PresignedHandler(http.server.SimpleHTTPRequestHandler):
    """Plays an object store serving a presigned URL: a wrong signature is refused, as S3 would (so an
    unresolved reference fails the run), and its access log is not ours to write."""

    expected_sig_sha256 = ""

    def _signed(self) -> bool:
        sig = parse_qs(urlsplit(self.path).query).get("X-Amz-Signature", [""])[0]
        if hashlib.sha256(sig.encode()).hexdigest() == self.expected_sig_sha256:
            return True
        self.send_error(403, "SignatureDoesNotMatch")
        return False

    def do_GET(self):
        if self._signed():
            super().do_GET()

    def do_HEAD(self):
        if self._signed():
            super().do_HEAD()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def data_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote-data")
    (root / "data.csv").write_text("x,y\n" + "".join(f"{i},{i % 2}\n" for i in range(64)))
    handler = type("Handler", (_PresignedHandler,),
                   {"expected_sig_sha256": hashlib.sha256(PLANTED["DataSig"].encode()).hexdigest()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on a free loopback port: (tracking URI with user:password, its directory).
    Its store, artifacts and log are scanned with each ladder's output."""
    home = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    log = open(home / "server.log", "wb")
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "TMPDIR": str(home)}
    proc = subprocess.Popen(
        [str(Path(PYTHON).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{home}/mlflow.db",
         "--artifacts-destination", str(home / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=home, start_new_session=True)
    wait_healthy(f"http://127.0.0.1:{port}/health", proc, home / "server.log", 240, "mlflow server")  # ~35 s busy
    yield f"http://canary-user:{PLANTED['TrackingPw']}@127.0.0.1:{port}", home
    os.killpg(proc.pid, 15)
    proc.wait(timeout=30)
    log.close()


def _traingate_run(scanned_dir: Path, tracking_uri: str, args: list[str], name: str,
                   extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    state = scanned_dir / "state"
    tmp = scanned_dir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "TRAINGATE_", "MLFLOW_", "AWS_"))}
    env.update({
        "TRAINGATE_STATE_DIR": str(state), "PREFECT_HOME": str(state / "prefect"), "TMPDIR": str(tmp),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "INFO",
        "TRAINGATE_TRACKING_URI": tracking_uri,
        "TRAINGATE_PREFECT_SERVER": "temporary",  # its database under state/prefect is scanned with the rest
        "AWS_SECRET_ACCESS_KEY": PLANTED["AwsSecret"], "MY_SERVICE_TOKEN": PLANTED["ServiceToken"],
        # The temporary server's auth string, as an operator would give it (else the CLI generates one).
        "PREFECT_SERVER_API_AUTH_STRING": f"traingate:{PLANTED['PrefectAuth']}",
        **(extra_env or {}),
    })
    proc = subprocess.run([PYTHON, "-m", "flows.cli", "run", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1400)
    (scanned_dir / f"terminal-{name}.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    return proc


def _script_spec(scanned_dir: Path, inputs: Path, data_server: str) -> Path:
    project = scanned_dir / "project"
    shutil.copytree(ROOT / "examples" / "script_project", project)
    expected = hashlib.sha256(PLANTED["ScriptToken"].encode()).hexdigest()
    (project / "canary_train.py").write_text(CANARY_SCRIPT.replace("EXPECTED_TOKEN_SHA256", repr(expected)))
    spec = yaml.safe_load((ROOT / "examples" / "script.yaml").read_text())
    script = spec["recipe"]["script"]
    script["command"] = ["python", "canary_train.py", "--lr", "0.1", "--api-token", PLANTED["ScriptToken"],
                         "--wandb-key", PLANTED["WandbKey"]]
    script["workdir"] = str(project)
    spec["data"] = {"uri": f"{data_server}/data.csv?X-Amz-Algorithm=AWS4-HMAC-SHA256"
                           f"&X-Amz-Credential={PLANTED['DataCred']}&X-Amz-Signature={PLANTED['DataSig']}"}
    # A literal chat-webhook URL (its token is its path); the data server answers its posts, if an alert fires.
    spec["alerts"] = {"webhook_url": f"{data_server}/hooks/{PLANTED['HookToken']}"}
    path = inputs / "script.yaml"  # the user's input holds the literal secrets; it is outside the scanned tree
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _every_file(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]


def _assert_nothing_leaked(*roots: Path) -> None:
    leaks, files = [], [p for root in roots for p in _every_file(root)]
    assert len(files) > 40, sorted(map(str, files))  # databases, artifacts, stage files, logs: real output
    for path in files:
        data = path.read_bytes()
        leaks += [f"{name} in {path}" for name, value in PLANTED.items() if value.encode() in data]
    assert not leaks, "\n".join(leaks)


def _assert_passed(proc: subprocess.CompletedProcess) -> None:
    # The secrets must not have cost the run anything, so a leak-free result is not a failed run's.
    assert proc.returncode == 0 and "pipeline PASSED" in proc.stdout, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.timeout(1800)  # an mlflow server, a temporary Prefect server and a ladder on 2 shared cores
def test_a_digits_ladder_writes_no_byte_of_the_secrets_in_its_environment_tracking_uri_and_overrides(
        tmp_path, mlflow_server):
    tracking_uri, server_home = mlflow_server
    spec = tmp_path / "digits.yaml"  # the user's input, outside the scanned tree
    spec.write_text(TINY_DIGITS)
    scanned = tmp_path / "written"
    proc = _traingate_run(scanned, tracking_uri, [
        str(spec), "--set", f"identity.purpose=canary ladder, api_key={PLANTED['SetPurpose']}"], "digits")
    _assert_passed(proc)
    assert list((scanned / "state").glob("prefect/*.db")) and (server_home / "mlflow.db").exists()
    assert "api_key=${env:TRAINGATE_SECRET_1}" in next((scanned / "state").glob("runs/*/spec.yaml")).read_text()
    _assert_nothing_leaked(scanned, server_home)


@pytest.mark.timeout(1800)
def test_a_script_ladder_writes_no_byte_of_the_secrets_in_its_arguments_data_uri_and_output(
        tmp_path, mlflow_server, data_server):
    tracking_uri, server_home = mlflow_server
    scanned = tmp_path / "written"
    scanned.mkdir()
    proc = _traingate_run(scanned, tracking_uri, [
        str(_script_spec(scanned, tmp_path, data_server)),
        "--set", f"recipe.script.stage_args.full=[--steps, '200', --password, {PLANTED['SetPassword']}]"], "script",
        PLANTED_ENV)
    _assert_passed(proc)
    full = next((scanned / "state").glob("runs/*/full/stdout.log")).read_text()
    # The script got every secret, resolved (it checked the token), and printed it; what was written is masked.
    assert "canary: --api-token *** --password *** --wandb-key ***" in full
    assert "canary: AWS_SECRET_ACCESS_KEY=***" in full and "canary: MY_SERVICE_TOKEN=***" in full
    assert "canary: DB_PASS=***" in full and "canary: DATABASE_DSN=***" in full
    assert "canary: PREFECT_API_AUTH_STRING=***" in full  # the client's copy of the server's auth string
    assert "/hooks/${env:TRAINGATE_SECRET_" in next((scanned / "state").glob("runs/*/spec.yaml")).read_text()
    _assert_nothing_leaked(scanned, server_home)
