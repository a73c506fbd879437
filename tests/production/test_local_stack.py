"""The production stack of infra/docker-compose.yml, run natively by infra/local-stack.sh: every service's
command, environment and healthcheck from the compose file, PostgreSQL 15 from Debian, moto as the S3
endpoint, on free loopback ports with its state under a tmp dir. The ladder deployment runs on the
stack's worker; the pools bootstrap waits for a server that starts late; compose and script agree."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tgtest import PYTHON, ROOT, TINY_DIGITS, free_port, stop_tree, tail, wait_healthy

sys.path.insert(0, str(ROOT / "infra"))
import local_stack  # noqa: E402

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
def stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("stack") / "stack"
    _searchable_for_postgres(d.parent)
    t0 = time.monotonic()
    up = _stack(d, "up")
    up_s = time.monotonic() - t0
    procs = _tree(d)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        client = dict(line.split("=", 1) for line in up.stdout.splitlines() if "=" in line and not line.startswith("#"))
        yield {"dir": d, "up": up, "up_s": up_s, "client": client, "secrets": _secrets(d)}
    finally:
        procs += _tree(d)
        down = _stack(d, "down", timeout=300)
        assert down.returncode == 0, down.stdout + down.stderr
        _assert_gone(procs, d)


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
    from prefect.settings import PREFECT_API_URL, temporary_settings

    d, client = stack["dir"], stack["client"]
    # every service healthy by its compose healthcheck, run natively
    status = _stack(d, "status", timeout=300)
    assert status.returncode == 0, status.stdout + status.stderr
    compose = yaml.safe_load((ROOT / "infra" / "docker-compose.yml").read_text())
    for name, svc in compose["services"].items():
        if svc.get("healthcheck"):
            assert re.search(rf"^{re.escape(name)}: healthy 127\.0\.0\.1:\d+$", status.stdout, re.M), status.stdout
    # no secret on the terminal
    for v in stack["secrets"].values():
        assert v not in stack["up"].stdout + stack["up"].stderr + status.stdout
    settings = local_stack.read_env_file(local_stack.SETTINGS)
    bucket = settings["TRAINGATE_BUCKET"]
    s3 = _s3(stack)
    s3.head_bucket(Bucket=bucket)

    t0 = time.monotonic()
    with temporary_settings(updates={PREFECT_API_URL: client["PREFECT_API_URL"]}):
        run = run_deployment("ladder/ladder-cpu", parameters={"spec": yaml.safe_load(TINY_DIGITS), "until": "smoke"},
                             timeout=RUN_TIMEOUT_S, poll_interval=2)
    run_s = time.monotonic() - t0
    assert run.state.is_completed(), f"{run.state.message}; worker log: {tail(d / 'logs' / 'worker-cpu-local.log')}"
    print(f"\nstack up {stack['up_s']:.1f} s; ladder-cpu until smoke on the stack's worker {run_s:.1f} s")

    mlflow = MlflowClient(client["TRAINGATE_TRACKING_URI"])
    exp = mlflow.get_experiment_by_name("tests")
    (pipeline,) = mlflow.search_runs([exp.experiment_id], "tags.`traingate.kind` = 'pipeline'")
    assert pipeline.data.tags["traingate.reached_stage"] == "smoke"
    # the tracking server's store is the stack's PostgreSQL, its artifacts the stack's bucket
    assert _pg_count(stack, settings["MLFLOW_DB"], "select count(*) from runs") >= 1
    assert _pg_count(stack, settings["MLFLOW_DB"], "select count(*) from metrics") > 0
    assert exp.artifact_location.startswith("mlflow-artifacts:"), exp.artifact_location
    assert _keys(s3, bucket, "mlartifacts/"), "no MLflow artifact in the bucket"
    assert _keys(s3, bucket, "checkpoints/"), "no checkpoint in the bucket"
    # the pool got the locations from the bootstrap, no secret among them
    from prefect import get_client
    with temporary_settings(updates={PREFECT_API_URL: client["PREFECT_API_URL"]}):
        with get_client(sync_client=True) as c:
            pool_env = c.read_work_pool("cpu-local").base_job_template["variables"]["properties"]["env"]["default"]
        # pool-secrets stored the credentials a container pool's flow runs load by name
        from prefect.blocks.system import Secret
        blocks = dict(e.split("=", 1) for e in settings["TRAINGATE_SECRET_BLOCKS"].split(","))
        assert Secret.load(blocks["PGPASSWORD"]).get() == stack["secrets"]["POSTGRES_PASSWORD"]
        assert Secret.load(blocks["AWS_SECRET_ACCESS_KEY"]).get() == stack["secrets"]["S3_SECRET_KEY"]
    assert pool_env["TRAINGATE_STATE_DIR"] == client["TRAINGATE_STATE_DIR"] == str(d / "volumes" / "state")
    assert pool_env["TRAINGATE_SECRET_BLOCKS"] == settings["TRAINGATE_SECRET_BLOCKS"]
    assert not any(v in str(pool_env) for v in stack["secrets"].values())

    # down keeps the data: up again, the run and its artifacts are still there
    procs = _tree(d)
    down = _stack(d, "down", timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
    _assert_gone(procs, d)
    again = _stack(d, "up")
    assert again.returncode == 0, again.stdout + again.stderr
    assert [r.info.run_id for r in mlflow.search_runs([exp.experiment_id], "tags.`traingate.kind` = 'pipeline'")] \
        == [pipeline.info.run_id]
    assert _keys(_s3(stack), bucket, "mlartifacts/") == _keys(s3, bucket, "mlartifacts/")


def _late_server(port: int, tmp: Path):
    env = {**os.environ, "PREFECT_HOME": str(tmp / "server-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{tmp / 'prefect.db'}"}
    log = tmp / "server.log"
    with log.open("wb") as out:
        return subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True), log


def _bootstrap(tmp: Path, port: int, **extra: str) -> tuple[subprocess.Popen, Path]:
    settings = local_stack.read_env_file(local_stack.SETTINGS)
    env = {**_bare_env(), "PATH": f"{BIN}:/usr/local/bin:/usr/bin:/bin", "PREFECT_HOME": str(tmp / "boot-home"),
           "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
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
    from prefect.settings import PREFECT_API_URL, temporary_settings

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
        with temporary_settings(updates={PREFECT_API_URL: url}):
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


SECRETS = {"POSTGRES_PASSWORD": "pw-0123456789abcdef", "S3_ACCESS_KEY": "key-0123456789", "S3_SECRET_KEY": "sk-0123456789"}


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
            assert p.argv[0] in {"prefect", "mlflow", "traingate", "bash", "/bin/sh"}, (name, p.argv)
    # healthchecks where the brief's services need them; the bootstrap waits for a healthy server
    assert {n for n, s in raw["services"].items() if s.get("healthcheck")} >= {"postgres", "minio", "prefect-server",
                                                                             "mlflow"}
    assert raw["services"]["pools-bootstrap"]["depends_on"]["prefect-server"] == {"condition": "service_healthy"}
    boot = by["pools-bootstrap"].env
    assert boot["TRAINGATE_IMAGE"] and Path(boot["TRAINGATE_STATE_DIR"]).is_absolute()
    assert compose["services"]["pools-bootstrap"]["environment"]["TRAINGATE_STATE_DIR"] == "/var/lib/traingate"
    # the bootstrap writes its environment into the pools' job templates: no secret in it
    assert not any(s in v for v in boot.values() for s in SECRETS.values())
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
    with pytest.raises(local_stack.StackError, match=r"POSTGRES_PASSWORD"):
        stack.plans(create=False)
    assert not (tmp_path / "s" / "secrets.env").exists()
