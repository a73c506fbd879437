"""The node list, the rendezvous check and the fan-out's refusal, without starting a training process."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tgtest import TINY_DIGITS
from traingate.job.stagejob import derive
from traingate.job.vocab import Cause, Status
from traingate.launch.command import stage_command
from traingate.launch.nodes import NODES_VAR, Node, check_rendezvous, parse_nodes
from traingate.settings import Settings
from traingate.spec import SpecError, apply_overrides, parse_spec
from traingate.supervision.supervisor import Hooks, supervise


@pytest.mark.parametrize("value, says", [
    (None, "resources.nodes = 2 needs TRAINGATE_NODES"),
    ("ssh:h1,h2", "unknown launcher 'ssh'"),
    ("netns:only-one", "names 1 distinct nodes but resources.nodes = 2"),
    ("netns:a,a", "names 1 distinct nodes but resources.nodes = 2"),
])
def test_a_bad_node_list_is_refused_in_one_line_naming_the_value_and_the_fix(value, says):
    with pytest.raises(SpecError) as e:
        parse_nodes(value, 2)
    assert says in str(e.value) and "netns:NS0,NS1" in str(e.value) and "\n" not in str(e.value)


def test_a_namespace_that_does_not_exist_is_refused_by_name():
    with pytest.raises(SpecError, match="namespace 'tg-no-such-ns' cannot be read"):
        parse_nodes("netns:tg-no-such-ns,tg-no-such-ns2", 2)


def test_the_rendezvous_must_be_node_0s_address():
    nodes = [Node("a", "10.77.0.1", "tga0", ()), Node("b", "10.77.0.2", "tgb0", ())]
    check_rendezvous(nodes, "10.77.0.1:29400")
    with pytest.raises(SpecError, match=r"set resources.rdzv_endpoint=10.77.0.1:29400"):
        check_rendezvous(nodes, "10.77.0.2:29400")


def test_namespaces_are_read_as_nodes_with_their_address_and_interface(hosts):
    a, b = parse_nodes(hosts.nodes_var, 2)
    assert (a.addr, b.addr) == (hosts.addr_a, hosts.addr_b)
    assert a.ifname.startswith("tga") and b.prefix == ("ip", "netns", "exec", hosts.b)


def _two_node_job(tmp_path: Path):
    spec = parse_spec(apply_overrides(yaml.safe_load(TINY_DIGITS), [
        "resources.nodes=2", "resources.procs_per_node=1", "resources.rdzv_endpoint=10.77.0.1:29411",
        "tracking.enabled=false"]))
    return derive(spec, "full", run_id="r", run_dir=tmp_path, settings=Settings.from_env())


def test_a_two_node_job_is_launched_as_one_agent_per_node_with_a_rendezvous_per_attempt(tmp_path):
    job = _two_node_job(tmp_path)
    cmd = stage_command(job, "/py")
    assert cmd[:3] == ["/py", "-m", "traingate.launch.nodes"]
    assert cmd[cmd.index("--rdzv-id") + 1] == "r.full.0"
    agent = cmd[cmd.index("--") + 1:]
    assert "--nnodes=2" in agent and "--rdzv-endpoint=10.77.0.1:29411" in agent
    assert stage_command(job.next_attempt("worker_lost", 1.0), "/py")[cmd.index("--rdzv-id") + 1] == "r.full.1"


def test_a_two_node_stage_without_a_node_list_stops_as_a_user_error_without_restarts(tmp_path, monkeypatch):
    monkeypatch.delenv(NODES_VAR, raising=False)
    sup = supervise(_two_node_job(tmp_path), Hooks(info=lambda _: None))
    assert sup.status == Status.FAILED and sup.cause == Cause.USER_ERROR and sup.restarts == 0
    assert f"resources.nodes = 2 needs {NODES_VAR}" in sup.error
