"""The production stack of infra/docker-compose.yml, run natively by infra/local-stack.sh: every service's
command, environment and healthcheck from the compose file, PostgreSQL 15 from Debian, moto as the S3
endpoint, on free loopback ports with its state under a tmp dir. The ladder deployment runs on the
stack's worker; the pools bootstrap waits for a server that starts late; compose and script agree. Every
service authenticates its clients (an anonymous walk over both servers' route tables), MLflow keeps teams
apart and lets only the platform identity move @champion, and every service has least-privilege
credentials. A headless Chromium logs in to the stack's Prefect UI with its auth string, finds a flow run on the
runs page and the ladder deployment's run form with its fields in declared order from the PostgreSQL-backed
server."""
from __future__ import annotations

import contextlib
import inspect
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml
from tgtest import PYTHON, ROOT, TINY_DIGITS, free_port, prefect_api_at, stop_tree, tail, wait_healthy

sys.path.insert(0, str(ROOT / "infra"))
import local_stack  # noqa: E402
from traingate.settings import environment  # noqa: E402

BIN = Path(PYTHON).parent
SCRIPT = ROOT / "infra" / "local-stack.sh"
RUN_TIMEOUT_S = 600


def _bare_env(**extra: str) -> dict[str, str]:
    """A user's shell on a bare VM: no location, no Prefect or MLflow setting of this test process."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8",
            "TRAINGATE_PYTHON": PYTHON, **extra}


def _searchable_for_postgres(d: Path) -> None:
    """PostgreSQL runs as the postgres user when we are root; pytest's base temp dir is 0700 (search only, no listing)."""
    if os.geteuid() != 0:
        return
    for p in [d, *d.parents]:
        if p == Path("/") or p == Path("/tmp"):
            break
        p.chmod(p.stat().st_mode | 0o001)


def _stack(d: Path, action: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), action], env=_bare_env(TRAINGATE_STACK_DIR=str(d)), cwd=d.parent,
                          capture_output=True, text=True, timeout=timeout)


def _processes_of(d: Path) -> list[psutil.Process]:
    """Every live process that names the stack dir in its command line or environment."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
            continue
        try:
            text = " ".join(p.info["cmdline"] or []) + " " + " ".join(p.environ().values())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if str(d) in text:
            out.append(p)
    return out


def _tree(d: Path) -> list[psutil.Process]:
    stack = local_stack.Stack(d, env={})
    roots = [rec["pid"] for rec in stack.state["procs"].values()]
    pm = Path(stack._pgdata()) / "postmaster.pid"
    if pm.exists():
        roots.append(int(pm.read_text().split()[0]))
    out = []
    for pid in roots:
        try:
            p = psutil.Process(pid)
            out += [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return out


def _assert_gone(procs: list[psutil.Process], d: Path) -> None:
    deadline = time.monotonic() + 10
    while True:
        left = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] + _processes_of(d)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, [(p.pid, p.cmdline()[:4]) for p in left if p.is_running()]


def _secrets(d: Path) -> dict[str, str]:
    path = d / "secrets.env"
    assert path.stat().st_mode & 0o777 == 0o600
    return local_stack.read_env_file(path)


@pytest.fixture(scope="module")
def stack():
    # Not under pytest's temp root: a pytest session that starts while the stack runs resets that root to 0700,
    # and PostgreSQL (the postgres user when we are root) must still enter the stack dir to stop.
    base = Path(tempfile.mkdtemp(prefix="traingate-stack-"))
    d = base / "stack"
    _searchable_for_postgres(base)
    t0 = time.monotonic()
    up = _stack(d, "up")
    up_s = time.monotonic() - t0
    procs = _tree(d)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        client = dict(line.split("=", 1) for line in up.stdout.splitlines() if "=" in line and not line.startswith("#"))
        env = _stack(d, "env", timeout=120)
        assert env.returncode == 0, env.stdout + env.stderr
        # `env` is for a shell's eval: `export NAME=<shell-quoted value>`
        creds = dict(shlex.split(line.removeprefix("export "))[0].split("=", 1) for line in env.stdout.splitlines())
        assert {k: creds[k] for k in client} == client
        yield {"dir": d, "up": up, "up_s": up_s, "client": client, "creds": creds, "secrets": _secrets(d)}
    finally:
        procs += _tree(d)
        down = _stack(d, "down", timeout=300)
        assert down.returncode == 0, down.stdout + down.stderr
        _say_slow_stops(down.stdout)
        _assert_gone(procs, d)
        shutil.rmtree(base)


def _say_slow_stops(report: str) -> None:
    """A service that `down` had to kill after its stop grace period, or that took 10 s or more to stop: said in
    the run's warnings summary with every service's stop time, not failed."""
    import warnings

    slow = [line for line in report.splitlines()
            if "killed after" in line or ((m := re.search(r"\(([0-9.]+) s\)$", line)) and float(m.group(1)) >= 10)]
    if slow:
        warnings.warn("local stack down: " + "; ".join(report.splitlines()), stacklevel=2)


@contextlib.contextmanager
def _as_client(stack, mlflow_user: tuple[str, str] | None = None):
    """This process as a client of the stack: Prefect's auth string and an MLflow user (default: the platform
    identity the workers use), as `eval "$(infra/local-stack.sh env)"` gives a shell."""
    
    creds = stack["creds"]
    user, password = mlflow_user or (creds["MLFLOW_TRACKING_USERNAME"], creds["MLFLOW_TRACKING_PASSWORD"])
    with environment({"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password}), \
            prefect_api_at(creds["PREFECT_API_URL"], PREFECT_API_AUTH_STRING=creds["PREFECT_API_AUTH_STRING"]):
        yield


def _s3(stack):
    import boto3
    return boto3.client("s3", endpoint_url=stack["client"]["TRAINGATE_S3_ENDPOINT_URL"], region_name="us-east-1",
                        aws_access_key_id=stack["secrets"]["S3_ACCESS_KEY"],
                        aws_secret_access_key=stack["secrets"]["S3_SECRET_KEY"])


def _keys(s3, bucket: str, prefix: str) -> list[str]:
    return [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]


def _pg_count(stack, db: str, sql: str) -> int:
    import psycopg2
    port = local_stack.Stack(stack["dir"], env={}).state["ports"]["postgres"]
    settings = local_stack.read_env_file(local_stack.SETTINGS)
    with psycopg2.connect(host="127.0.0.1", port=port, dbname=db, user=settings["POSTGRES_USER"],
                          password=stack["secrets"]["POSTGRES_PASSWORD"]) as conn, conn.cursor() as cur:
        cur.execute(sql)
        return cur.fetchone()[0]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_native_stack_comes_up_healthy_runs_the_ladder_deployment_on_its_worker_and_down_leaves_no_process(stack):
    from mlflow.tracking import MlflowClient
    from prefect.deployments import run_deployment

    d, client = stack["dir"], stack["client"]
    # every service healthy by its compose healthcheck, run natively
    status = _stack(d, "status", timeout=300)
    assert status.returncode == 0, status.stdout + status.stderr
    compose = yaml.safe_load((ROOT / "infra" / "docker-compose.yml").read_text())
    for name, svc in compose["services"].items():
        if svc.get("healthcheck"):
            assert re.search(rf"^{re.escape(name)}: healthy 127\.0\.0\.1:\d+$", status.stdout, re.M), status.stdout
    # the UI in a browser calls the API where the server listens (its /ui-settings names the API's URL)
    import httpx
    api = client["PREFECT_API_URL"]
    ui = httpx.get(api.removesuffix("/api") + "/ui-settings", timeout=30,
                   auth=tuple(stack["creds"]["PREFECT_API_AUTH_STRING"].split(":", 1)))
    assert ui.status_code == 200 and ui.json()["api_url"] == api, (ui.status_code, ui.text[:300])
    # no secret on the terminal
    for v in stack["secrets"].values():
        assert v not in stack["up"].stdout + stack["up"].stderr + status.stdout
    settings = local_stack.read_env_file(local_stack.SETTINGS)
    bucket = settings["TRAINGATE_BUCKET"]
    s3 = _s3(stack)
    s3.head_bucket(Bucket=bucket)

    t0 = time.monotonic()
    with _as_client(stack):
        run = run_deployment("ladder/ladder-cpu", parameters={"spec": yaml.safe_load(TINY_DIGITS), "until": "smoke"},
                             timeout=RUN_TIMEOUT_S, poll_interval=2)
    run_s = time.monotonic() - t0
    assert run.state.is_completed(), f"{run.state.message}; worker log: {tail(d / 'logs' / 'worker-cpu-local.log')}"
    print(f"\nstack up {stack['up_s']:.1f} s; ladder-cpu until smoke on the stack's worker {run_s:.1f} s")

    mlflow = MlflowClient(client["TRAINGATE_TRACKING_URI"])
    with _as_client(stack):
        exp = mlflow.get_experiment_by_name("tests")
        (pipeline,) = mlflow.search_runs([exp.experiment_id], "tags.`traingate.kind` = 'pipeline'")
    assert pipeline.data.tags["traingate.reached_stage"] == "smoke"
    # the tracking server's store is the stack's PostgreSQL, its artifacts the stack's bucket
    assert _pg_count(stack, settings["MLFLOW_DB"], "select count(*) from runs") >= 1
    assert _pg_count(stack, settings["MLFLOW_DB"], "select count(*) from metrics") > 0
    assert exp.artifact_location.startswith("mlflow-artifacts:"), exp.artifact_location
    # an operator's shell is a client with `eval "$(infra/local-stack.sh env)"`: the traingate and prefect CLIs
    # authenticate with what it exports; without it the Prefect CLI is refused
    cli = f'eval "$({SCRIPT} env)" && {BIN}/traingate runs --experiment tests && {BIN}/prefect work-pool ls'
    shell = subprocess.run(["bash", "-c", cli], env=_bare_env(TRAINGATE_STACK_DIR=str(d), PREFECT_HOME=str(
        d.parent / "cli-home")), cwd=d.parent, capture_output=True, text=True, timeout=300)
    assert shell.returncode == 0 and pipeline.info.run_id in shell.stdout and "cpu-local" in shell.stdout, \
        shell.stdout + shell.stderr
    anonymous = subprocess.run([str(BIN / "prefect"), "work-pool", "ls"], env=_bare_env(
        PREFECT_API_URL=client["PREFECT_API_URL"], PREFECT_HOME=str(d.parent / "anonymous-home")),
        capture_output=True, text=True, timeout=300)
    assert anonymous.returncode != 0 and "cpu-local" not in anonymous.stdout, anonymous.stdout + anonymous.stderr
    assert _keys(s3, bucket, "mlartifacts/"), "no MLflow artifact in the bucket"
    assert _keys(s3, bucket, "checkpoints/"), "no checkpoint in the bucket"
    # the pool got the locations from the bootstrap, no secret among them
    from prefect import get_client
    with _as_client(stack):
        with get_client(sync_client=True) as c:
            pool_env = c.read_work_pool("cpu-local").base_job_template["variables"]["properties"]["env"]["default"]
        # pool-secrets stored the credentials a container pool's flow runs load by name: the workers' own
        from prefect.blocks.system import Secret
        blocks = dict(e.split("=", 1) for e in settings["TRAINGATE_SECRET_BLOCKS"].split(","))
        assert Secret.load(blocks["PGPASSWORD"]).get() == stack["secrets"]["OPTUNA_DB_PASSWORD"]
        assert Secret.load(blocks["AWS_SECRET_ACCESS_KEY"]).get() == stack["secrets"]["S3_WORKER_SECRET_KEY"]
        assert Secret.load(blocks["MLFLOW_TRACKING_PASSWORD"]).get() == stack["secrets"]["MLFLOW_PLATFORM_PASSWORD"]
    assert pool_env["TRAINGATE_STATE_DIR"] == client["TRAINGATE_STATE_DIR"] == str(d / "volumes" / "state")
    assert pool_env["TRAINGATE_SECRET_BLOCKS"] == settings["TRAINGATE_SECRET_BLOCKS"]
    assert not any(v in str(pool_env) for v in stack["secrets"].values())

    # down keeps the data: up again, the run and its artifacts are still there
    procs = _tree(d)
    down = _stack(d, "down", timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
    _say_slow_stops(down.stdout)
    _assert_gone(procs, d)
    again = _stack(d, "up")
    assert again.returncode == 0, again.stdout + again.stderr
    with _as_client(stack):
        assert [r.info.run_id for r in mlflow.search_runs([exp.experiment_id], "tags.`traingate.kind` = 'pipeline'")] \
            == [pipeline.info.run_id]
    assert _keys(_s3(stack), bucket, "mlartifacts/") == _keys(s3, bucket, "mlartifacts/")


def _prefect_routes() -> set[tuple[str, str]]:
    """Every (method, path) of the Prefect server's API app, from its route table and its OpenAPI paths."""
    from prefect.server.api.server import create_api_app

    api = create_api_app(ignore_cache=True)
    routes = {(m.upper(), path) for path, ops in api.openapi()["paths"].items() for m in ops}
    return routes | {(m, r.path) for r in api.routes if getattr(r, "path", None) for m in getattr(r, "methods", None)
                     or {"GET"}}


def _mlflow_routes() -> set[tuple[str, str]]:
    """Every (method, path) the MLflow server serves: its FastAPI routes, the Flask app's URL map and the
    auth app's own routes (users, permissions, roles)."""
    import mlflow.server.auth.routes as auth_routes
    from mlflow.server import app as flask_app
    from mlflow.server.fastapi_app import create_fastapi_app

    routes = {(m, r.path) for r in create_fastapi_app(flask_app).routes for m in getattr(r, "methods", None) or ()}
    routes |= {(m, rule.rule) for rule in flask_app.url_map.iter_rules() for m in rule.methods - {"HEAD", "OPTIONS"}}
    return routes | {(m, path) for name, path in vars(auth_routes).items()
                     if name.isupper() and isinstance(path, str) and path.startswith("/") for m in ("GET", "POST")}


def _anonymous_answers(base: str, routes: set[tuple[str, str]]) -> dict[tuple[str, str], int]:
    import httpx

    out = {}
    with httpx.Client(base_url=base, timeout=60) as h:
        for method, path in sorted(routes):
            url = re.sub(r"\{[^}]+\}|<[^>]+>", "00000000-0000-0000-0000-000000000000", path)
            body = {} if method in ("POST", "PUT", "PATCH") else None
            out[method, path] = h.request(method, url, json=body).status_code
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_route_of_both_servers_refuses_an_anonymous_client_except_health(stack):
    prefect = _anonymous_answers(stack["client"]["PREFECT_API_URL"], _prefect_routes())
    mlflow = _anonymous_answers(stack["client"]["TRAINGATE_TRACKING_URI"], _mlflow_routes())
    assert len(prefect) > 150 and len(mlflow) > 400, (len(prefect), len(mlflow))
    open_prefect = {k: v for k, v in prefect.items() if v not in (401, 403)}
    open_mlflow = {k: v for k, v in mlflow.items() if v not in (401, 403)}
    print(f"\nanonymous: Prefect {len(prefect)} routes, {len(open_prefect)} open {sorted(open_prefect)}; "
          f"MLflow {len(mlflow)} routes, {len(open_mlflow)} open {sorted(open_mlflow)}")
    assert open_prefect == {("GET", "/health"): 200, ("GET", "/ready"): 200}
    # MLflow's: health, the UI's static files and server-info, which the auth app serves to anyone (how the
    # server is configured, before a login: no tenant data)
    assert {k for k, v in open_mlflow.items() if v == 200} == {
        ("GET", "/health"), ("GET", "/api/3.0/mlflow/server-info"), ("GET", "/ajax-api/3.0/mlflow/server-info")}
    assert {k for k, v in open_mlflow.items() if v != 200} <= {(m, p) for m, p in mlflow if p.startswith("/static")}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_team_a_cannot_move_or_delete_team_b_models_and_only_the_platform_identity_moves_champion(stack):
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException
    from mlflow.server.auth.client import AuthServiceClient

    uri = stack["client"]["TRAINGATE_TRACKING_URI"]
    settings = local_stack.read_env_file(local_stack.SETTINGS)
    admin = (settings["MLFLOW_AUTH_ADMIN_USERNAME"], stack["secrets"]["MLFLOW_ADMIN_PASSWORD"])
    tag = secrets.token_hex(3)  # fresh names: the test also runs against a stack that lives on
    teams = {team: (f"{team}-{tag}", secrets.token_hex(12)) for team in ("team-a", "team-b")}
    model = f"team-b-model-{tag}"
    with _as_client(stack, admin):
        for user, password in teams.values():
            AuthServiceClient(uri).create_user(user, password)

    def refused(call, *args) -> str | None:
        try:
            call(*args)
        except MlflowException as e:
            return e.error_code
        return None

    # the platform identity (the workers' flow runs) registers team B's model and promotes v1
    with _as_client(stack):
        c = MlflowClient(uri)
        run = c.create_run(c.create_experiment(f"team-b-ladder-{tag}"))
        c.set_terminated(run.info.run_id)
        c.create_registered_model(model)
        v1, v2 = (c.create_model_version(model, f"{run.info.artifact_uri}/model", run.info.run_id).version
                  for _ in range(2))
        c.set_registered_model_alias(model, "champion", v1)
    for team in ("team-a", "team-b"):
        with _as_client(stack, teams[team]):
            c = MlflowClient(uri)
            assert c.get_model_version_by_alias(model, "champion").version == v1  # every team reads
            assert refused(c.set_registered_model_alias, model, "champion", v2) == "PERMISSION_DENIED"
            assert refused(c.delete_registered_model_alias, model, "champion") == "PERMISSION_DENIED"
            assert refused(c.delete_model_version, model, v1) == "PERMISSION_DENIED"
            assert refused(c.delete_registered_model, model) == "PERMISSION_DENIED"
            assert refused(c.log_param, run.info.run_id, "forged", "1") == "PERMISSION_DENIED"
    # what team B creates itself, team A cannot change
    with _as_client(stack, teams["team-b"]):
        own = MlflowClient(uri).create_run(MlflowClient(uri).create_experiment(f"team-b-own-{tag}"))
    with _as_client(stack, teams["team-a"]):
        c = MlflowClient(uri)
        assert refused(c.log_metric, own.info.run_id, "forged", 1.0) == "PERMISSION_DENIED"
        assert refused(c.delete_run, own.info.run_id) == "PERMISSION_DENIED"
    with _as_client(stack):
        c = MlflowClient(uri)
        c.set_registered_model_alias(model, "champion", v2)
        assert c.get_model_version_by_alias(model, "champion").version == v2


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_stack_gives_each_service_least_privilege_and_keeps_its_secret_files_private(stack):
    import boto3
    import httpx
    import psycopg2

    d, sec, creds = stack["dir"], stack["secrets"], stack["creds"]
    settings = local_stack.read_env_file(local_stack.SETTINGS)
    st = local_stack.Stack(d, env={})
    port = st.state["ports"]["postgres"]
    # files holding secrets or data: owner only
    assert (d / "secrets.env").stat().st_mode & 0o777 == 0o600
    assert (d / "home" / "mlflow" / "mlflow-auth.ini").stat().st_mode & 0o777 == 0o600
    assert Path(st._pgdata()).stat().st_mode & 0o777 == 0o700

    def connect(user: str, password: str, db: str):
        return psycopg2.connect(host="127.0.0.1", port=port, dbname=db, user=user, password=password)

    # one role per service, none a superuser; each reaches its own database only
    with connect(settings["POSTGRES_USER"], sec["POSTGRES_PASSWORD"], "postgres") as conn, conn.cursor() as cur:
        cur.execute("select rolname, rolsuper, rolcreaterole, rolcreatedb from pg_roles where rolname = any(%s)",
                    ([settings["POSTGRES_DB"], settings["MLFLOW_DB"], settings["OPTUNA_DB"]],))
        assert sorted(cur.fetchall()) == sorted((r, False, False, False) for r in (
            settings["POSTGRES_DB"], settings["MLFLOW_DB"], settings["OPTUNA_DB"]))
    conn.close()
    connect(settings["OPTUNA_DB"], creds["PGPASSWORD"], settings["OPTUNA_DB"]).close()  # the workers' role
    for db in (settings["POSTGRES_DB"], settings["MLFLOW_DB"], settings["MLFLOW_AUTH_DB"]):
        with pytest.raises(psycopg2.OperationalError, match="permission denied for database"):
            connect(settings["OPTUNA_DB"], creds["PGPASSWORD"], db)
    with pytest.raises(psycopg2.OperationalError, match="permission denied for database"):
        connect(settings["MLFLOW_DB"], sec["MLFLOW_DB_PASSWORD"], settings["POSTGRES_DB"])
    # Prefect's Secret blocks (pool-secrets stored some) are encrypted with a key kept outside its database
    with connect(settings["POSTGRES_DB"], sec["PREFECT_DB_PASSWORD"], settings["POSTGRES_DB"]) as conn, \
            conn.cursor() as cur:
        cur.execute("select count(*) from configuration where key = 'ENCRYPTION_KEY'")
        assert cur.fetchone()[0] == 0
        cur.execute("select count(*) from block_document where name like 'traingate-%'")
        assert cur.fetchone()[0] >= 3
    conn.close()
    # Prefect: a state-changing request with the auth string but without a CSRF token is refused; the UI is
    # told to ask for the auth string at login and to send CSRF tokens
    api = creds["PREFECT_API_URL"]
    ui = httpx.get(api.removesuffix("/api") + "/ui-settings", timeout=60).json()
    assert (ui["auth"], ui["csrf_enabled"]) == ("BASIC", True)
    auth = tuple(creds["PREFECT_API_AUTH_STRING"].split(":", 1))
    with httpx.Client(base_url=api, auth=auth, timeout=60) as h:
        assert h.post("/flows/filter", json={}).status_code == 403
        token = h.get("/csrf-token", params={"client": "tg-test"}).json()["token"]
        assert h.post("/flows/filter", json={}, headers={"Prefect-Csrf-Token": token,
                                                         "Prefect-Csrf-Client": "tg-test"}).status_code == 200
    # S3: one key per service, allowed the bucket only; the root key is the bucket/users setup's. The native
    # store (moto with its IAM checks on, infra/moto_s3_server.py) refuses everything else with 403.
    from botocore.exceptions import ClientError

    assert creds["AWS_ACCESS_KEY_ID"] == sec["S3_WORKER_ACCESS_KEY"] != sec["S3_ACCESS_KEY"]
    url, bucket, other = creds["TRAINGATE_S3_ENDPOINT_URL"], settings["TRAINGATE_BUCKET"], "tg-least-privilege"

    def client(service: str, key: str, secret: str):
        return boto3.client(service, endpoint_url=url, region_name="us-east-1", aws_access_key_id=key,
                            aws_secret_access_key=secret)

    def refused(call, **kw) -> int:
        with pytest.raises(ClientError) as e:
            call(**kw)
        return e.value.response["ResponseMetadata"]["HTTPStatusCode"]

    root = client("s3", sec["S3_ACCESS_KEY"], sec["S3_SECRET_KEY"])
    root.create_bucket(Bucket=other)
    root.put_object(Bucket=other, Key="k", Body=b"other")
    try:
        for service in ("S3_MLFLOW", "S3_WORKER"):
            key, secret = sec[f"{service}_ACCESS_KEY"], sec[f"{service}_SECRET_KEY"]
            s3, iam = client("s3", key, secret), client("iam", key, secret)
            obj = f"least-privilege/{service}"
            s3.head_bucket(Bucket=bucket)
            s3.put_object(Bucket=bucket, Key=obj, Body=b"mine")
            assert s3.get_object(Bucket=bucket, Key=obj)["Body"].read() == b"mine"
            assert _keys(s3, bucket, "least-privilege/") == [obj]
            assert not s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": obj}]}).get("Errors")
            assert _keys(s3, bucket, "least-privilege/") == []
            assert refused(s3.get_object, Bucket=other, Key="k") == 403
            assert refused(s3.put_object, Bucket=other, Key="k", Body=b"") == 403
            assert refused(s3.list_objects_v2, Bucket=other) == 403
            assert refused(s3.list_buckets) == 403
            assert refused(s3.create_bucket, Bucket="tg-a-service-bucket") == 403
            assert refused(s3.delete_bucket, Bucket=bucket) == 403
            assert refused(iam.list_users) == 403
            assert refused(iam.create_access_key, UserName=key) == 403
            assert refused(iam.put_user_policy, UserName=key, PolicyName="all", PolicyDocument=(
                '{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"*","Resource":"*"}]}')) == 403
        # an unknown key, a service's key with a wrong secret
        assert refused(client("s3", "AKIAUNKNOWNKEY000000", "x").list_objects_v2, Bucket=bucket) == 403
        assert refused(client("s3", sec["S3_WORKER_ACCESS_KEY"], "wrong").list_objects_v2, Bucket=bucket) == 403
        # anonymous requests, and moto's control routes (reset-auth would switch the checks off for everyone)
        for method, path in [("GET", "/"), ("GET", f"/{bucket}"), ("PUT", f"/{bucket}/anonymous"),
                             ("GET", f"/{other}/k"), ("POST", "/moto-api/reset-auth"), ("POST", "/moto-api/reset"),
                             ("GET", "/moto-api/data.json"), ("GET", "/moto-api/")]:
            assert httpx.request(method, url + path, content=b"0", timeout=60).status_code == 403, (method, path)
        worker = client("s3", sec["S3_WORKER_ACCESS_KEY"], sec["S3_WORKER_SECRET_KEY"])
        assert refused(worker.get_object, Bucket=other, Key="k") == 403  # the checks are still on
        assert root.get_object(Bucket=other, Key="k")["Body"].read() == b"other"  # and nothing was reset
    finally:
        root.delete_object(Bucket=other, Key="k")
        root.delete_bucket(Bucket=other)


CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@contextlib.contextmanager
def _browser():
    """Headless Chromium driven by Selenium, Debian's chromium and chromium-driver (make test-deps)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    # no sandbox: root in CI; no /dev/shm: small in containers
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


# The labels of every list of fields on a Prefect UI form, each list in the order the page shows it.
_FORM_FIELDS = """return [...document.querySelectorAll('.schema-form-properties')].map(list =>
    [...list.querySelectorAll(':scope > .schema-form-property')].map(p =>
        p.querySelector('.schema-form-property__label').textContent.trim()));"""


def _field_name(label: str) -> str:
    """'Run Name (Optional)' -> 'run_name': the UI shows a field's JSON-schema title (pydantic's, from its name)."""
    return label.removesuffix("(Optional)").strip().lower().replace(" ", "_")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason="chromium and chromium-driver are not installed: "
                    "make test-deps installs them (apt-get install chromium chromium-driver)")
def test_the_prefect_ui_logs_in_with_the_auth_string_lists_flow_runs_and_shows_the_ladder_form_in_declared_order(
        stack):
    import httpx
    from prefect import get_client
    from prefect.states import Cancelled
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
    from selenium.common.exceptions import TimeoutException

    from flows.pipeline import ladder
    from traingate.spec import Identity, RunSpec

    api = stack["creds"]["PREFECT_API_URL"]
    ui = api.removesuffix("/api")
    auth = stack["creds"]["PREFECT_API_AUTH_STRING"]
    name = f"ui-check-{secrets.token_hex(3)}"  # the test also runs against a stack that lives on
    with _as_client(stack), get_client(sync_client=True) as c:
        deployment = c.read_deployment_by_name("ladder/ladder-cpu")
        # a flow run of the ladder deployment that no worker picks up, for the runs page to list
        c.create_flow_run_from_deployment(deployment.id, name=name, state=Cancelled(message="listed by the UI test"))
    # what the PostgreSQL-backed server returns: JSONB's key order, not the declared one
    stored = httpx.get(f"{api}/deployments/{deployment.id}", auth=tuple(auth.split(":", 1)), timeout=60).json()
    assert list(stored["parameter_openapi_schema"]["definitions"]["RunSpec"]["properties"]) != \
        list(RunSpec.model_fields)

    t0 = time.monotonic()
    with _browser() as browser:
        wait = WebDriverWait(browser, 60)
        browser.get(f"{ui}/runs")  # anonymous: the UI asks for the auth string, as it does a person
        wait.until(lambda b: "/login" in b.current_url)
        field = wait.until(lambda b: b.find_element(By.CSS_SELECTOR, "input[type=password]"))
        field.send_keys(auth, Keys.ENTER)
        wait.until(lambda b: b.current_url.endswith("/runs") and name in b.find_element(By.TAG_NAME, "body").text)

        browser.get(f"{ui}/deployments/deployment/{deployment.id}/run")
        # The form renders section by section: read it once the spec's sections are all there (a busy box
        # showed 10 of 14); on a timeout the last read goes to the assertions below, which name the difference.
        read: list = []

        def complete(b):
            read[:] = [b.execute_script(_FORM_FIELDS) or []]
            found = read[0]
            return len(found) > 2 and len(found[1]) >= len(RunSpec.model_fields) and found

        try:
            lists = wait.until(complete)
        except TimeoutException:
            lists = read[0] if read else []
        assert "Authentication failed" not in browser.find_element(By.TAG_NAME, "body").text
    shown = [[_field_name(label) for label in fields] for fields in lists]
    print(f"\nbrowser: login, runs page, ladder-cpu run form {time.monotonic() - t0:.1f} s")
    assert shown[0] == list(inspect.signature(ladder.fn).parameters)  # spec, until, resume_from
    assert shown[1] == list(RunSpec.model_fields)  # the spec's sections: identity, recipe, data, ...
    assert shown[2] == list(Identity.model_fields)


# The auth string of the late server and its bootstrap, as the stack's: the session's (tests/conftest.py), which
# this process's Prefect client sends.
LATE_AUTH = os.environ["PREFECT_API_AUTH_STRING"]


def _late_server(port: int, tmp: Path):
    env = {**os.environ, "PREFECT_HOME": str(tmp / "server-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_API_AUTH_STRING": LATE_AUTH,
           "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{tmp / 'prefect.db'}"}
    log = tmp / "server.log"
    with log.open("wb") as out:
        return subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True), log


def _bootstrap(tmp: Path, port: int, **extra: str) -> tuple[subprocess.Popen, Path]:
    settings = local_stack.read_env_file(local_stack.SETTINGS)
    env = {**_bare_env(), "PATH": f"{BIN}:/usr/local/bin:/usr/bin:/bin", "PREFECT_HOME": str(tmp / "boot-home"),
           "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_AUTH_STRING": LATE_AUTH,
           "TRAINGATE_CODE_DIR": str(ROOT), "TRAINGATE_POOLS_CONFIG": settings["TRAINGATE_POOLS_CONFIG"],
           "TRAINGATE_STATE_DIR": str(tmp / "state"), "TRAINGATE_IMAGE": settings["TRAINGATE_IMAGE"], **extra}
    log = tmp / "bootstrap.log"
    with log.open("wb") as out:
        return subprocess.Popen(["bash", str(ROOT / "infra" / "pools" / "create_pools.sh")], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True), log


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_pools_bootstrap_started_before_the_prefect_server_succeeds_once_the_server_answers(tmp_path):
    from prefect import get_client

    port = free_port()
    boot, boot_log = _bootstrap(tmp_path, port)
    server = None
    try:
        time.sleep(6)
        assert boot.poll() is None, f"the bootstrap did not wait for the server: {tail(boot_log)}"
        server, server_log = _late_server(port, tmp_path)
        url = f"http://127.0.0.1:{port}/api"
        wait_healthy(f"{url}/health", server, server_log, 180, "prefect server")
        assert boot.wait(600) == 0, tail(boot_log)
        with prefect_api_at(url):
            with get_client(sync_client=True) as c:
                pools = {name: c.read_work_pool(name) for name in ("cpu-local", "gpu-a100", "gpu-h100")}
                deployed = {dep.name for dep in c.read_deployments()}
        for pool in pools.values():
            assert pool.base_job_template["variables"]["properties"]["env"]["default"]["TRAINGATE_STATE_DIR"] == \
                str(tmp_path / "state")
        assert deployed == {dep["name"] for dep in yaml.safe_load(
            (ROOT / "deployments" / "prefect.yaml").read_text())["deployments"]}
    finally:
        stop_tree(boot, signal.SIGTERM, 10)
        if server is not None:
            stop_tree(server, signal.SIGTERM, 30)


def test_the_pools_bootstrap_gives_up_in_one_line_when_the_api_never_answers(tmp_path):
    port = free_port()
    boot, log = _bootstrap(tmp_path, port, TRAINGATE_API_WAIT_S="3")
    assert boot.wait(60) == 1
    assert log.read_text() == (f"create_pools: the Prefect API at http://127.0.0.1:{port}/api did not answer within 3s "
                               "(TRAINGATE_API_WAIT_S)\n")


SECRETS = {var: f"s{i}-{var.lower()}-0123456789" for i, var in enumerate(local_stack.SECRET_VARS)}


def test_the_native_stack_runs_every_compose_service_with_its_environment_and_healthcheck(tmp_path):
    compose_text = (ROOT / "infra" / "docker-compose.yml").read_text()
    raw = yaml.safe_load(compose_text)
    stack = local_stack.Stack(tmp_path / "stack", env={"PATH": "/usr/bin:/bin", **SECRETS})
    compose, plans = stack.plans()
    by = {p.name: p for p in plans}
    assert set(by) == set(raw["services"])  # every compose service is covered, none invented
    ports = stack.state["ports"]
    for name, svc in compose["services"].items():
        p = by[name]
        # same variable names; values the same but host names, ports and volume paths mapped to this machine
        want = local_stack.service_environment(svc)
        assert set(want) <= set(p.env), name
        for k, v in want.items():
            assert p.env[k] == stack.localize(v, name, {s: (int(raw["services"][s]["expose"][0]), ports[s])
                                                        for s in ports}, stack.path_map(compose)), (name, k)
            assert not re.search(r"\b(postgres|minio|mlflow|prefect-server):\d+", p.env[k]), (name, k, p.env[k])
        if svc.get("healthcheck"):
            assert p.healthcheck, name
        if p.kind == "command":
            assert p.argv[0] in {"prefect", "python", "traingate", "bash", "/bin/sh"}, (name, p.argv)
    # healthchecks where the brief's services need them; the bootstrap waits for a healthy server
    assert {n for n, s in raw["services"].items() if s.get("healthcheck")} >= {"postgres", "minio", "prefect-server",
                                                                             "mlflow"}
    assert raw["services"]["pools-bootstrap"]["depends_on"]["prefect-server"] == {"condition": "service_healthy"}
    boot = by["pools-bootstrap"].env
    assert boot["TRAINGATE_IMAGE"] and Path(boot["TRAINGATE_STATE_DIR"]).is_absolute()
    assert compose["services"]["pools-bootstrap"]["environment"]["TRAINGATE_STATE_DIR"] == "/var/lib/traingate"
    # the bootstrap writes its environment's locations into the pools' job templates: no secret among them
    assert not any(s in v for k, v in boot.items() if k != "PREFECT_API_AUTH_STRING" for s in SECRETS.values())
    # a worker for every pool of the pools config
    settings = local_stack.read_env_file(local_stack.SETTINGS)
    pools = set(yaml.safe_load((ROOT / settings["TRAINGATE_POOLS_CONFIG"]).read_text())["pools"])
    workers = {p.argv[p.argv.index("--pool") + 1] for p in plans if "--pool" in p.argv}
    assert workers == pools
    # every image pinned; every ${VAR} is a setting of infra/stack.env or a secret
    for name, svc in compose["services"].items():
        tag = svc["image"].rsplit("/", 1)[-1]
        assert ":" in tag and not tag.endswith(":latest"), (name, svc["image"])
    used = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", compose_text))
    assert used <= set(settings) | set(SECRETS), used - set(settings) - set(SECRETS)


def test_the_native_stack_refuses_a_missing_secret_in_one_line_and_compose_interpolation_works(tmp_path):
    assert local_stack.interpolate("${A:-x}/${B}/$$C/${D-y}", {"B": "b", "D": ""}) == "x/b/$C/"
    with pytest.raises(local_stack.StackError, match=r"^\$\{X\}: set X$"):
        local_stack.interpolate("${X:?set X}", {"X": ""})
    stack = local_stack.Stack(tmp_path / "s", env={"PATH": "/usr/bin:/bin"})
    with pytest.raises(local_stack.StackError, match=r"^\$\{(\w+)\}: set \1 in infra/\.env$"):
        stack.plans(create=False)
    assert not (tmp_path / "s" / "secrets.env").exists()


def test_every_service_of_the_stack_gets_only_its_own_credentials_and_the_servers_demand_them(tmp_path):
    stack = local_stack.Stack(tmp_path / "stack", env={"PATH": "/usr/bin:/bin", **SECRETS})
    compose, plans = stack.plans()
    by = {p.name: p for p in plans}

    def holders(var: str) -> set[str]:
        return {p.name for p in plans if any(SECRETS[var] in v for v in [*p.env.values(), *p.argv])}

    # the superuser's password and the S3 root key stay with the store that owns them and its one-shot setup
    assert holders("POSTGRES_PASSWORD") == {"postgres"}
    assert holders("S3_ACCESS_KEY") == holders("S3_SECRET_KEY") == {"minio", "create-bucket"}
    assert holders("PREFECT_DB_PASSWORD") == {"postgres", "prefect-server"}
    assert holders("MLFLOW_DB_PASSWORD") == {"postgres", "mlflow"}
    assert holders("S3_MLFLOW_SECRET_KEY") == {"create-bucket", "mlflow"}
    assert holders("PREFECT_ENCRYPTION_KEY") == {"prefect-server"}
    assert holders("MLFLOW_ADMIN_PASSWORD") == {"mlflow", "mlflow-users"}
    assert holders("MLFLOW_SECRET_KEY") == {"mlflow"}
    workers = {p.name for p in plans if "--pool" in p.argv}  # the cpu-local worker runs wrapped (flows/warm_engine.py)
    assert holders("OPTUNA_DB_PASSWORD") == {"postgres", "pool-secrets", *workers}
    assert holders("S3_WORKER_SECRET_KEY") == {"create-bucket", "pool-secrets", *workers}
    assert holders("MLFLOW_PLATFORM_PASSWORD") == {"mlflow-users", "pool-secrets", *workers}
    # no service connects to PostgreSQL as the superuser: each as the role named after its database
    settings = local_stack.read_env_file(local_stack.SETTINGS)
    pg_urls = {(p.name, u) for p in plans for u in re.findall(r"postgresql[+\w]*://[^\s'\"]+", " ".join(
        [*p.env.values(), *p.argv]))}
    assert pg_urls and not any(f"//{settings['POSTGRES_USER']}" in u for _, u in pg_urls), pg_urls
    for _, u in pg_urls:
        role, db = re.match(r"postgresql[+\w]*://([^:@]+)[^/]*/(\w+)", u).groups()
        assert role == db or (role, db) == (settings["MLFLOW_DB"], settings["MLFLOW_AUTH_DB"]), u
    # the Docker socket: only the docker workers mount it (to start containers); no flow-run container gets it
    mounts = {n: [str(v) for v in s.get("volumes") or []] for n, s in compose["services"].items()}
    assert {n for n, vols in mounts.items() if any(local_stack.DOCKER_SOCKET in v for v in vols)} == \
        {p.name for p in plans if "--pool" in p.argv and "docker" in p.argv}
    assert local_stack.DOCKER_SOCKET not in settings["TRAINGATE_DOCKER_VOLUMES"]
    # the servers demand credentials, CSRF tokens and keep Prefect's Secret key outside its database
    server = by["prefect-server"].env
    assert server["PREFECT_SERVER_API_AUTH_STRING"] == SECRETS["PREFECT_AUTH_STRING"]
    assert server["PREFECT_SERVER_ENCRYPTION_KEY"] == SECRETS["PREFECT_ENCRYPTION_KEY"]
    assert server["PREFECT_SERVER_CSRF_PROTECTION_ENABLED"] == "true"
    assert by["mlflow"].argv[:2] == ["bash", str(ROOT / "infra" / "mlflow" / "server.sh")]
    assert "--app-name basic-auth" in (ROOT / "infra" / "mlflow" / "server.sh").read_text()
    # every Prefect client authenticates; every MLflow client is the platform identity, not the admin
    for p in plans:
        client = "PREFECT_API_URL" in p.env or p.argv[:1] == ["prefect"] and p.name != "prefect-server"
        if p.kind == "command" and client:
            assert p.env.get("PREFECT_API_AUTH_STRING") == SECRETS["PREFECT_AUTH_STRING"], p.name
    for name in {"pool-secrets", *workers}:
        assert by[name].env["MLFLOW_TRACKING_USERNAME"] == settings["MLFLOW_TRACKING_USERNAME"] != \
            settings["MLFLOW_AUTH_ADMIN_USERNAME"]
        assert by[name].env["MLFLOW_TRACKING_PASSWORD"] == SECRETS["MLFLOW_PLATFORM_PASSWORD"]


_UP_FROM_A_BACKGROUND_JOB = """
import signal, subprocess, sys
sys.path.insert(0, sys.argv[1])
import local_stack
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell's background job, or a pytest-xdist worker
signal.signal(signal.SIGQUIT, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
local_stack._let_stop_signals_through({signal.SIGINT, signal.SIGTERM, signal.SIGQUIT})
child = subprocess.run(["cat", "/proc/self/status"], capture_output=True, text=True).stdout
masks = dict(line.split(":\\t") for line in child.splitlines() if line.startswith(("SigIgn", "SigBlk")))
print(" ".join(str((int(masks[m], 16) >> (sig - 1)) & 1) for m in ("SigIgn", "SigBlk")
               for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)))
"""


def test_a_stack_started_with_its_stop_signals_ignored_or_blocked_starts_services_that_get_them():
    out = subprocess.run([sys.executable, "-c", _UP_FROM_A_BACKGROUND_JOB, str(ROOT / "infra")],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["0"] * 6, out.stdout + out.stderr  # none ignored, none blocked in a started service
