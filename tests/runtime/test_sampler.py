"""ResumableSampler: exact position, and what holds when the world size changes on resume."""
from __future__ import annotations

import pytest

from traingate.runtime.sampler import ResumableSampler


def test_a_resumed_sampler_yields_exactly_the_batches_the_uninterrupted_one_would():
    ref = ResumableSampler(50, 8, seed=7)
    expected = [ref.next_batch() for _ in range(20)]  # crosses epochs
    s = ResumableSampler(50, 8, seed=7)
    got = [s.next_batch() for _ in range(9)]
    state = s.state_dict()
    t = ResumableSampler(50, 8, seed=7)
    t.load_state_dict(state)
    got += [t.next_batch() for _ in range(11)]
    assert got == expected


@pytest.mark.parametrize("old_world,new_world", [(2, 1), (1, 2), (2, 3)])
def test_resuming_with_another_world_size_neither_skips_nor_repeats_a_sample_of_the_epoch(old_world, new_world):
    n, micro = 97, 4
    s = ResumableSampler(n, micro * old_world, seed=1)
    seen: list[int] = []
    for _ in range(5):
        batch = s.next_batch()
        seen += [i for r in range(old_world) for i in ResumableSampler.shard(batch, r, old_world)]
    t = ResumableSampler(n, micro * new_world, seed=1)
    t.load_state_dict(s.state_dict())
    while t.epoch == 0:
        batch = t.next_batch()
        if t.epoch:
            break
        seen += [i for r in range(new_world) for i in ResumableSampler.shard(batch, r, new_world)]
    assert len(seen) == len(set(seen)), "a sample was repeated"
    assert seen == t.permutation(0)[:len(seen)], "a sample was skipped"
    assert n - len(seen) < micro * new_world  # only the epoch's short tail is dropped


def test_a_sampler_refuses_a_position_saved_for_other_data():
    s = ResumableSampler(10, 2, seed=0)
    with pytest.raises(ValueError, match="same data and optim.seed"):
        ResumableSampler(12, 2, seed=0).load_state_dict(s.state_dict())
