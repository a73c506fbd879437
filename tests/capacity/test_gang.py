"""Gang placement: all slots at once, one node or whole nodes; fragmentation."""
from __future__ import annotations

from traingate.capacity.gang import footprint, fragmented, free_per_node, place
from traingate.capacity.jobs import Job


def test_a_job_no_wider_than_a_node_goes_to_the_fullest_node_that_fits():
    assert place(2, [8, 3, 2, 5], gpus_per_node=8) == (2,)
    assert place(4, [8, 3, 2, 5], gpus_per_node=8) == (3,)


def test_a_job_wider_than_a_node_takes_whole_free_nodes_or_nothing():
    assert place(16, [8, 7, 8, 8], gpus_per_node=8) == (0, 2)
    assert place(16, [8, 7, 7, 7], gpus_per_node=8) is None   # 29 GPUs free, one whole node


def test_a_job_never_spans_nodes_when_it_fits_one():
    assert place(4, [3, 3, 3], gpus_per_node=8) is None


def test_a_wide_job_that_is_not_a_multiple_of_the_node_holds_every_gpu_of_its_nodes():
    assert footprint(12, 8) == 16
    assert footprint(8, 8) == 8
    running = [Job("w", "t", "research", "p", 12, 0.0, started_s=0.0, nodes=(0, 2))]
    assert free_per_node(3, 8, running) == [0, 8, 0]


def test_free_gpus_are_fragmented_only_when_enough_are_free_but_not_where_the_head_needs_them():
    assert fragmented([2, 2], head_slots=4, gpus_per_node=4) == 4
    assert fragmented([2, 1], head_slots=4, gpus_per_node=4) == 0   # too few: not fragmentation
    assert fragmented([4, 1], head_slots=4, gpus_per_node=4) == 0   # it fits
    assert fragmented([2, 2], head_slots=None, gpus_per_node=4) == 0  # nobody waits: idle
