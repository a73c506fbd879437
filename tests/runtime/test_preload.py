"""Recipe data a zygote preloads (traingate.runtime.warm calls train.preload_data once its first workers are
forked): a worker forked afterwards trains on that data instead of loading its own, and only for the same spec."""
from __future__ import annotations

import torch

from traingate.job.stagejob import derive
from traingate.runtime import train
from traingate.runtime.dist import DistInfo
from traingate.settings import Settings
from traingate.spec import load_spec

ONE_PROCESS = DistInfo(0, 1, 0, torch.device("cpu"), None)


def _job(tiny_spec, tmp_path, name: str, *overrides: str):
    spec = load_spec(tiny_spec(name=f"{name}.yaml"), ["tracking.enabled=false", *overrides])
    return derive(spec, "full", run_id=name, run_dir=tmp_path / name, settings=Settings.from_env())


def test_a_trainer_takes_the_data_preloaded_for_its_spec_and_loads_its_own_for_another_spec(
        tiny_spec, state_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(train, "_preloaded", {})
    job = _job(tiny_spec, tmp_path, "preloaded")
    key = train.preload_data(job.write())
    assert key == job.spec.spec_hash() and list(train._preloaded) == [key]
    assert train.preload_data(job.job_path) == key and len(train._preloaded) == 1  # loaded once per spec
    preloaded_train, preloaded_val = train._preloaded[key]

    same = train.Trainer(job, ONE_PROCESS)
    other_job = _job(tiny_spec, tmp_path, "other", "optim.lr=0.01")
    other_job.write()  # a training process finds its stage directory made (main() makes it)
    other = train.Trainer(other_job, ONE_PROCESS)
    try:
        assert same.val is preloaded_val and same.train is preloaded_train
        assert other.val is not preloaded_val  # another spec: its own load, of the same data here
        assert all(torch.equal(a, b) for a, b in zip(other.val.tensors, preloaded_val.tensors))
        assert all(torch.equal(a, b) for a, b in zip(other.train.tensors, preloaded_train.tensors))
    finally:
        same.close()
        other.close()
