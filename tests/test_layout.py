"""Design decisions guarded by tests: the core library never imports prefect; the
deployment file and the compose file are valid and point at real flows and pools."""
from __future__ import annotations

import ast
import inspect
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tgtest import PYTHON, ROOT
from traingate.spec import _default_pools


def test_traingate_never_imports_prefect():
    code = (
        "import pkgutil, importlib, sys, traingate\n"
        "for m in pkgutil.walk_packages(traingate.__path__, 'traingate.'):\n"
        "    if '.checks.' not in m.name: importlib.import_module(m.name)\n"
        "bad = sorted(n for n in sys.modules if n == 'prefect' or n.startswith('prefect.'))\n"
        "print(len(bad)); sys.exit(1 if bad else 0)\n")
    p = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, f"traingate imported prefect: {p.stdout} {p.stderr[-2000:]}"


# ------------------------------------------------------------------ layering: who may import whom
PACKAGES = ("traingate", "flows", "tasks")
# Orchestrator-side code: it never runs inside a training process (the ranks torchrun starts).
ORCHESTRATOR_SIDE = ("prefect", "flows", "tasks", "optuna", "traingate.supervision.supervisor",
                     "traingate.supervision.drivers", "traingate.supervision.watch", "traingate.supervision.alerting",
                     "traingate.supervision.attempts",
                     "traingate.supervision.drill", "traingate.launch", "traingate.ladder",
                     "traingate.tracking.runs", "traingate.promotion", "traingate.supervision.slurm_result",
                     "traingate.tracking.browse", "traingate.sweep.driver", "traingate.sweep.study")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, *, at_run_time: bool = False) -> set[str]:
    """Project modules ``name`` imports: anywhere in it, or only those a run imports (function bodies
    included; not ``if TYPE_CHECKING:``, which only a type checker reads)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if at_run_time and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return visit_all(node.orelse)
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
        visit_all(ast.iter_child_nodes(node))

    def visit_all(nodes) -> None:
        for n in nodes:
            visit(n)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m.split(".")[0] in PACKAGES}


def _importers(of: str, packages: tuple[str, ...]) -> list[str]:
    return sorted(f"{name} imports {m}" for name, path in _modules().items() if name.split(".")[0] in packages
                  for m in _imports(name, path) if m == of or m.startswith(of + "."))


def test_the_core_library_imports_neither_flows_nor_tasks():
    assert _importers("flows", ("traingate",)) + _importers("tasks", ("traingate",)) == []
    assert _importers("tasks", ("flows",)), "the scan finds nothing, not even flows importing tasks"


def test_tasks_never_import_flows():
    assert _importers("flows", ("tasks",)) == []


def _orchestrator_modules_imported_by(code: str) -> list[str]:
    import json

    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    p = subprocess.run([PYTHON, "-c", probe], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    loaded = json.loads(p.stdout.strip().splitlines()[-1])
    assert "traingate" in loaded
    return sorted(m for m in loaded if any(m == o or m.startswith(o + ".") for o in ORCHESTRATOR_SIDE))


def test_the_training_process_imports_no_orchestrator_module():
    # What a rank imports: the runtime's entry point and every built-in recipe it can be asked to build.
    assert _orchestrator_modules_imported_by(
        "import traingate.runtime.train\nfrom traingate.recipes import recipe_names\nrecipe_names()") == []
    # The probe can fail: the promotion code is orchestrator-side and pulls in the run records.
    assert "traingate.tracking.runs" in _orchestrator_modules_imported_by("import traingate.promotion.register")


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as a path (first node repeated at the end), or [] if it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (found := dfs(start)):
            return found
    return []


def test_packages_and_modules_import_each_other_without_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]  # the finder finds one
    modules = _modules()
    packages: dict[str, set[str]] = {}
    for name, path in modules.items():
        for m in _imports(name, path):
            if m.split(".")[0] != name.split(".")[0]:
                packages.setdefault(name.split(".")[0], set()).add(m.split(".")[0])
    assert _cycle(packages) == [], "the packages import each other in a cycle"
    # Module level, imports inside functions included: a cycle there is one a later edit turns into an
    # import-time deadlock, and two modules that need each other are one module.
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for m in _imports(name, path, at_run_time=True):
            parts = m.split(".")  # importing a.b.c imports the packages a and a.b first
            targets.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules)
        graph[name] = {t for t in targets if t != name and not name.startswith(t + ".")}
    assert _cycle(graph) == [], "modules import each other in a cycle at import time"


# ------------------------------------------------------------------ layers: imports point down only
# Every room (a module at the top of traingate/, a traingate sub-package, tasks, flows) on one floor, from
# the ground up; docs/layout.md draws them. A module imports only its own room and the rooms below it, so
# the rooms never import each other in a circle. A new room gets its floor here.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("commandenv", "specbase", "redact", "settings", "alerts", "sweepspec", "spec", "places", "secrets",
                    "storage", "snapshots", "units")),
    ("contract", ("job",)),
    ("scheduled, trained, remembered", ("capacity", "recipes", "tracking")),
    ("training process", ("runtime",)),
    ("around a run", ("launch", "cost", "promotion", "sweep", "monitor")),
    ("running a stage", ("supervision",)),
    ("the ladder", ("ladder",)),
    ("orchestration", ("tasks", "flows")),
)
ORDER = [room for _, rooms in FLOORS for room in rooms]


def _room(module: str) -> str:
    """``traingate.ladder.plan`` -> ``ladder``; ``traingate.spec`` -> ``spec``; ``flows.cli.run`` -> ``flows``."""
    parts = module.split(".")
    return parts[1] if parts[0] == "traingate" and len(parts) > 1 else parts[0]


def _upward(imports: dict[str, set[str]]) -> list[str]:
    """Each import of a room that stands above the importer's, as 'A (room) imports B (room above)'."""
    return sorted(f"{a} ({_room(a)}) imports {b} ({_room(b)}, above it)" for a, targets in imports.items()
                  for b in targets if ORDER.index(_room(b)) > ORDER.index(_room(a)))


def test_imports_point_down_the_floors_only():
    assert _upward({"traingate.job.files": {"traingate.ladder.plan", "traingate.spec"}}) == [
        "traingate.job.files (job) imports traingate.ladder.plan (ladder, above it)"]  # the check sees one
    modules = _modules()
    # Tests shipped inside the package (recipes/checks/) may import what they test.
    code = {n: p for n, p in modules.items() if not n.rsplit(".", 1)[-1].startswith("test_") and n != "traingate"}
    assert sorted({_room(n) for n in code} - set(ORDER)) == [], "a room without a floor: add it to FLOORS"
    imports = {name: {t for m in _imports(name, path)  # every import: in functions, under TYPE_CHECKING too
                      if (t := next((c for c in (m, m.rsplit(".", 1)[0]) if c in modules), None)) and t != "traingate"}
               for name, path in code.items()}
    assert _upward(imports) == []


# ------------------------------------------------------------------ imports inside functions
MAX_LAZY = 15


def _lazy_imports() -> list[tuple[str, int, str]]:
    """(file, line, reason) of every import inside a function body; reason: its `# lazy:` comment."""
    out = []
    for name, path in _modules().items():
        lines = path.read_text().splitlines()

        def visit(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue
                if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                    above = []
                    for line in reversed(lines[: child.lineno - 1]):  # the comment lines just above
                        if not line.strip().startswith("#"):
                            break
                        above.insert(0, line.strip())
                    said = " ".join(above + [lines[child.lineno - 1]])
                    reason = re.search(r"# lazy: (.+)", said)
                    out.append((str(path.relative_to(ROOT)), child.lineno, reason.group(1) if reason else ""))
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(ast.parse("\n".join(lines)), False)
    return sorted(out)


def test_imports_inside_functions_are_few_and_each_says_why():
    lazy = _lazy_imports()
    assert lazy, "the scan finds none, not even the warm-restart entry's"
    assert [f"{f}:{n}" for f, n, why in lazy if not why] == [], "an import inside a function needs `# lazy: <reason>`"
    assert len(lazy) <= MAX_LAZY, "\n".join(f"{f}:{n}: {why}" for f, n, why in lazy)


def _deployments():
    return yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())["deployments"]


def test_every_deployment_points_at_a_flow_that_takes_its_parameters():
    from prefect.flows import load_flow_from_entrypoint

    for d in _deployments():
        path, name = d["entrypoint"].split(":")
        flow = load_flow_from_entrypoint(str(ROOT / path) + ":" + name)
        params = inspect.signature(flow.fn).parameters
        assert set(d["parameters"]) <= set(params), d["name"]
        # what a worker does before the flow starts: a spec mapping must be a valid RunSpec
        flow.validate_parameters(d["parameters"])


def test_deployed_spec_mappings_are_the_example_specs_on_their_pools():
    from traingate.spec import load_spec, parse_spec

    specs = {d["name"]: parse_spec(d["parameters"]["spec"]) for d in _deployments() if "spec" in d["parameters"]}
    digits, sweep = ROOT / "examples" / "digits.yaml", ROOT / "examples" / "digits_sweep.yaml"
    assert specs == {
        "ladder-cpu": load_spec(digits),
        "digits-nightly-retrain": load_spec(digits),
        "stage-cpu": load_spec(digits),
        "ladder-a100": load_spec(digits, ["resources.work_pool=gpu-a100"]),
        "sweep-h100": load_spec(sweep, ["resources.work_pool=gpu-h100"]),
    }


def test_resume_deployment_asks_only_for_the_run_to_resume():
    resume = next(d for d in _deployments() if d["name"] == "ladder-resume")
    assert resume["entrypoint"] == "flows/pipeline.py:ladder"
    assert "spec" not in resume["parameters"] and "resume_from" not in resume["parameters"]


def test_every_deployment_uses_a_known_work_pool():
    pools = set(_default_pools())
    for d in _deployments():
        assert d["work_pool"]["name"] in pools, d["name"]


def test_compose_file_is_valid_against_the_compose_spec():
    exe = Path(PYTHON).parent / "check-jsonschema"
    exe = str(exe) if exe.exists() else "check-jsonschema"
    p = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", str(ROOT / "infra" / "docker-compose.yml")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.long
def test_prefect_deploy_creates_every_deployment_with_its_schedule(prefect_harness, tmp_path):
    import os

    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL

    with get_client(sync_client=True) as c:
        for pool, kind in (("cpu-local", "process"), ("gpu-a100", "process"), ("gpu-h100", "process")):
            try:
                c.create_work_pool(WorkPoolCreate(name=pool, type=kind))
            except Exception as e:  # noqa: BLE001 - already exists from an earlier test in the session
                assert "already exists" in str(e).lower(), e
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "TRAINGATE_CODE_DIR": str(ROOT),
           "TRAINGATE_IMAGE": "traingate-train:test", "PREFECT_HOME": str(tmp_path / "home")}
    p = subprocess.run([str(Path(PYTHON).parent / "prefect"), "--no-prompt", "deploy", "--all",
                        "--prefect-file", "deployments/prefect.yaml"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with get_client(sync_client=True) as c:
        deployed = {d.name: d for d in c.read_deployments()}
    for d in _deployments():
        assert d["name"] in deployed
        assert deployed[d["name"]].work_pool_name == d["work_pool"]["name"]
    nightly = deployed["digits-nightly-retrain"]
    assert [s.schedule.cron for s in nightly.schedules] == ["0 3 * * *"]
