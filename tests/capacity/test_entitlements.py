"""The pools file's entitlements: who may use which class and quota on a local pool, refused in one line."""

from __future__ import annotations

import pytest

from traingate.capacity import entitlements
from traingate.capacity.pools import CapacityError, parse_config
from traingate.capacity.queue import rules_for

POOL = {"gpus_per_node": 4, "nodes": 1, "price_per_gpu_hour": 1.0, "worker": "process"}


def _cfg(**extra):
    tree = {
        "pools": {"p": POOL},
        "entitlements": {
            "default": {"classes": ["research"], "quota": {"p": 1}},
            "teams": {
                "vision": {"members": ["alice", "bob"], "classes": ["research", "production"], "quota": {"p": 4}},
                "ops": {"members": ["carol"], "classes": ["research", "urgent"]},
            },
        },
    }
    tree.update(extra)
    return parse_config(tree)


def test_a_member_gets_her_teams_classes_and_quota():
    cfg = _cfg()
    assert entitlements.problem(cfg, "alice", "vision", "production", "p", 4) is None
    assert cfg.quota_of("vision", "p") == 4


def test_a_user_outside_a_listed_team_is_refused_naming_the_team_and_its_members():
    why = entitlements.problem(_cfg(), "eve", "vision", "research", "p", 1)
    assert why is not None and why.startswith("identity.team = 'vision': OS user 'eve' is not a member")
    assert "(members: alice, bob)" in why and "entitlements.teams.vision.members" in why


def test_a_class_the_team_is_not_allowed_is_refused_naming_what_is_allowed():
    why = entitlements.problem(_cfg(), "bob", "vision", "urgent", "p", 1)
    assert why == (
        "resources.priority = 'urgent': team vision may use research, production "
        "(entitlements.teams.vision.classes); use one of them"
    )


def test_an_unlisted_team_gets_the_default_class_and_quota_not_unlimited():
    cfg = _cfg()
    assert entitlements.problem(cfg, "eve", "newteam", "research", "p", 1) is None
    assert "entitlements.default.classes" in (entitlements.problem(cfg, "eve", "newteam", "urgent", "p", 1) or "")
    over = entitlements.problem(cfg, "eve", "newteam", "research", "p", 2)
    assert over == (
        "2 slots on pool 'p' exceed team newteam's quota of 1 (entitlements.default.quota.p); "
        "lower resources.procs_per_node or resources.nodes"
    )
    # The scheduler caps the unlisted team at the default quota too; a listed team without one is uncapped.
    assert rules_for(cfg, "p", ["newteam", "ops"]).quotas == {"newteam": 1, "vision": 4}


def test_check_raises_the_one_line_and_without_entitlements_everyone_may_use_every_class():
    with pytest.raises(CapacityError, match=r"^resources.priority = 'urgent'"):
        entitlements.check(_cfg(), "alice", "vision", "urgent", "p", 1)
    open_cfg = parse_config({"pools": {"p": POOL}})
    assert entitlements.problem(open_cfg, "anyone", "any", "urgent", "p", 4) is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"default": {"classes": ["research"], "quota": {}}},
            "entitlements.default.quota: no quota for local pool 'p'",
        ),
        ({"default": {"classes": ["vip"], "quota": {"p": 1}}}, "entitlements.default.classes: 'vip' is not a priority"),
        (
            {
                "default": {"classes": ["research"], "quota": {"p": 1}},
                "teams": {"v": {"classes": ["research"], "quota": {"q": 1}}},
            },
            "entitlements.teams.v.quota.q: 'q' is not a local pool",
        ),
        ({"default": {"classes": ["research"], "quota": {"p": 0}}}, "entitlements.default.quota.p = 0"),
    ],
)
def test_a_bad_entitlements_section_is_one_line_naming_the_field(change, message):
    with pytest.raises(CapacityError) as e:
        parse_config({"pools": {"p": POOL}, "entitlements": change})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_quota_set_both_in_quotas_and_in_the_entitlement_is_refused():
    with pytest.raises(CapacityError, match=r"entitlements.teams.vision.quota.p: also set in quotas.vision.p"):
        _cfg(quotas={"vision": {"p": 2}})


def _pools_file(tmp_path, me: str):
    import yaml

    tree = {
        "pools": {"cpu-local": {"gpus_per_node": 2, "nodes": 1, "price_per_gpu_hour": 0.05, "worker": "process"}},
        "entitlements": {
            "default": {"classes": ["research"], "quota": {"cpu-local": 1}},
            "teams": {
                "vision": {"members": ["someone-else"], "classes": ["research"]},
                "mine": {"members": [me], "classes": ["research", "production"]},
            },
        },
    }
    path = tmp_path / "pools.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_validate_with_a_pools_file_refuses_a_team_or_class_this_os_user_is_not_entitled_to(
    tiny_spec, tmp_path, capsys
):
    from flows.cli import main as cli

    me = entitlements.os_user()
    pools = _pools_file(tmp_path, me)
    base = ["validate", str(tiny_spec()), "--pools", str(pools), "--set", "resources.work_pool=cpu-local"]
    assert cli([*base, "--set", "identity.team=vision"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"traingate: invalid spec: identity.team = 'vision': OS user '{me}' is not a member")
    assert "\n" not in err
    assert cli([*base, "--set", "identity.team=mine", "--set", "resources.priority=urgent"]) == 2
    assert "resources.priority = 'urgent': team mine may use research, production" in capsys.readouterr().err
    assert cli([*base, "--set", "identity.team=mine", "--set", "resources.priority=production"]) == 0


def test_run_and_the_ladder_refuse_a_team_the_os_user_is_not_in_from_the_servers_pools_config(
    tiny_spec, tmp_path, prefect_harness
):
    import yaml
    from prefect import get_client

    from flows.pipeline import check_entitled
    from tasks import slots
    from traingate.spec import load_spec

    tree = yaml.safe_load(_pools_file(tmp_path, entitlements.os_user()).read_text())
    spec_pools = "pools: {cpu-local: {gpus_per_node: 0, price_per_gpu_hour: 0.05}}\n"
    with get_client(sync_client=True) as c:
        slots.put_variable(c, slots.CONFIG_VAR, parse_config(tree).model_dump(mode="json"))
    try:
        spec = load_spec(tiny_spec(spec_pools), ["resources.work_pool=cpu-local", "identity.team=vision"])
        with pytest.raises(CapacityError, match=r"^identity.team = 'vision': OS user '.*' is not a member"):
            check_entitled(spec)
        check_entitled(load_spec(tiny_spec(spec_pools), ["resources.work_pool=cpu-local", "identity.team=mine"]))
    finally:
        with get_client(sync_client=True) as c:
            slots.delete_variable(c, slots.CONFIG_VAR)
