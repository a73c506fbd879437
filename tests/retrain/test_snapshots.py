"""``{latest}`` in data.uri: a pointer file, dated names, none found; on file:// and on a real S3 endpoint."""
from __future__ import annotations

import boto3
import pytest

from traingate.snapshots import newest, resolve_latest, resolve_spec
from traingate.spec import SpecError, load_spec_text

from retrain_data import publish, tiny_chargpt


def test_dated_names_resolve_to_the_newest_date_not_the_greatest_string(tmp_path):
    for i, version in enumerate(["2026-11-09", "2026-11-20", "2026-9-30"]):
        publish(tmp_path, version, seed=i)
    assert resolve_latest(f"{tmp_path.as_uri()}/{{latest}}/input.txt") == f"{tmp_path.as_uri()}/2026-11-20/input.txt"
    assert newest(["v9", "v10", "LATEST", ".staging", "_SUCCESS"]) == "v10"


def test_a_newer_snapshot_still_being_copied_is_passed_over(tmp_path):
    publish(tmp_path, "2026-11-20", seed=0)
    (tmp_path / "2026-11-21").mkdir()  # its input.txt has not arrived yet
    assert resolve_latest(f"{tmp_path.as_uri()}/{{latest}}/input.txt").endswith("/2026-11-20/input.txt")


def test_a_latest_pointer_file_wins_over_newer_names(tmp_path):
    publish(tmp_path, "2026-11-20", seed=0)
    publish(tmp_path, "2026-11-21", seed=1)
    (tmp_path / "LATEST").write_text("2026-11-20\n")
    assert resolve_latest(f"{tmp_path.as_uri()}/{{latest}}/input.txt").endswith("/2026-11-20/input.txt")
    (tmp_path / "LATEST").write_text("2026-12-01\n")
    with pytest.raises(SpecError, match=r"pointer file .*LATEST names '2026-12-01', but .* does not exist"):
        resolve_latest(f"{tmp_path.as_uri()}/{{latest}}/input.txt")


def test_no_snapshot_is_one_line_naming_data_uri_and_the_prefix(tmp_path):
    uri = f"{tmp_path.as_uri()}/corpus/{{latest}}/input.txt"
    with pytest.raises(SpecError) as e:
        resolve_latest(uri)
    assert str(e.value) == (f"data.uri = {uri!r}: no snapshot under {tmp_path.as_uri()}/corpus/ (no LATEST pointer "
                            "file and no version directory holding input.txt); publish one there or name a version "
                            "instead of {latest}")
    assert "\n" not in str(e.value)
    with pytest.raises(SpecError, match="must be a whole path segment"):
        resolve_latest(f"{tmp_path.as_uri()}/v{{latest}}/input.txt")


def test_a_spec_resolves_to_the_concrete_uri_and_a_spec_without_latest_is_unchanged(tmp_path):
    publish(tmp_path, "2026-11-20", seed=0)
    spec = load_spec_text(tiny_chargpt(f"{tmp_path.as_uri()}/{{latest}}/input.txt"))
    resolved = resolve_spec(spec)
    assert resolved.data.uri == f"{tmp_path.as_uri()}/2026-11-20/input.txt"
    assert resolved.model_dump(exclude={"data"}) == spec.model_dump(exclude={"data"})
    assert resolve_spec(resolved) is resolved


def test_s3_prefix_resolves_by_pointer_and_by_name_and_sees_a_snapshot_published_after_the_first_look(s3_server):
    s3 = boto3.client("s3", endpoint_url=s3_server["endpoint"])
    uri = "s3://tg-test/corpus/{latest}/input.txt"
    with pytest.raises(SpecError, match=r"no snapshot under s3://tg-test/corpus/"):
        resolve_latest(uri)
    for version in ("2026-11-19", "2026-11-20"):
        s3.put_object(Bucket="tg-test", Key=f"corpus/{version}/input.txt", Body=b"some text\n")
    assert resolve_latest(uri) == "s3://tg-test/corpus/2026-11-20/input.txt"
    s3.put_object(Bucket="tg-test", Key="corpus/2026-11-22/input.txt", Body=b"newer text\n")
    assert resolve_latest(uri) == "s3://tg-test/corpus/2026-11-22/input.txt"
    s3.put_object(Bucket="tg-test", Key="corpus/LATEST", Body=b"2026-11-19")
    assert resolve_latest(uri) == "s3://tg-test/corpus/2026-11-19/input.txt"


def test_traingate_retrain_without_a_snapshot_exits_2_with_one_line_and_starts_nothing(tmp_path, monkeypatch,
                                                                                      capsys):
    from flows.cli import main

    spec = tmp_path / "spec.yaml"
    uri = f"{tmp_path.as_uri()}/corpus/{{latest}}/input.txt"
    spec.write_text(tiny_chargpt(uri))
    monkeypatch.setenv("TRAINGATE_STATE_DIR", str(tmp_path / "state"))
    code = main(["retrain", str(spec)])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err == (f"traingate: invalid spec: data.uri = {uri!r}: no snapshot under {tmp_path.as_uri()}/corpus/ "
                        "(no LATEST pointer file and no version directory holding input.txt); publish one there or "
                        "name a version instead of {latest}\n")
    assert not (tmp_path / "state").exists()


def test_traingate_validate_prints_the_spec_with_the_newest_snapshot_it_would_train_on(tmp_path, monkeypatch,
                                                                                      capsys):
    import yaml

    from flows.cli import main

    publish(tmp_path / "corpus", "2026-11-20", seed=0)
    publish(tmp_path / "corpus", "2026-11-21", seed=1)
    spec = tmp_path / "spec.yaml"
    spec.write_text(tiny_chargpt(f"{tmp_path.as_uri()}/corpus/{{latest}}/input.txt"))
    monkeypatch.setenv("TRAINGATE_STATE_DIR", str(tmp_path / "state"))
    code = main(["validate", str(spec)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert yaml.safe_load(out)["data"]["uri"] == f"{tmp_path.as_uri()}/corpus/2026-11-21/input.txt"
