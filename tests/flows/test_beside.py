"""The ladder's writes beside its stages (flows.pipeline.Beside): kept until a launch, then one at a time in the order
they were kept, held while the ladder has work of its own between a stage's end and the next launch, and every
failure raised where the ladder settles them. Plain callables stand in for the tracking tasks: no server."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from flows import pipeline
from flows.pipeline import Beside


class Writes:
    """Kept writes that note when they start and end; ``gate[name]`` keeps one running until it is set."""

    def __init__(self) -> None:
        self.spans: dict[str, list[float]] = {}
        self.gate: dict[str, threading.Event] = {}
        self.lock = threading.Lock()

    def write(self, name: str, seconds: float = 0.0, fail: bool = False):
        def submit() -> list[Future]:
            done: Future = Future()
            with self.lock:
                self.spans[name] = [time.monotonic()]
            if name in self.gate:
                assert self.gate[name].wait(10)
            time.sleep(seconds)
            with self.lock:
                self.spans[name].append(time.monotonic())
            if fail:
                done.set_exception(RuntimeError(f"{name} failed"))
            else:
                done.set_result(name)
            return [done]

        return submit

    def started(self, name: str) -> bool:
        with self.lock:
            return name in self.spans


def _until(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.01)


def test_kept_writes_wait_for_a_launch_then_run_one_at_a_time_in_the_order_kept():
    beside, w = Beside(), Writes()
    for name in ("fill-parent", "fill-unit", "record-unit"):
        beside.after_next_launch(w.write(name, seconds=0.05))
    time.sleep(0.1)
    assert w.spans == {}  # nothing before the launch
    beside.launched()
    beside.settle()
    order = sorted(w.spans, key=lambda n: w.spans[n][0])
    assert order == ["fill-parent", "fill-unit", "record-unit"]
    for before, after in zip(order, order[1:]):
        assert w.spans[before][1] <= w.spans[after][0]  # never two at once


def test_a_stage_end_holds_the_next_write_until_the_next_launch():
    beside, w = Beside(), Writes()
    w.gate["record-smoke"] = threading.Event()
    beside.after_next_launch(w.write("record-smoke"))
    beside.after_next_launch(w.write("fill-canary"))
    beside.launched()
    _until(lambda: w.started("record-smoke"))
    beside.hold()  # the stage ended: the ladder decides its gate and starts the next one
    w.gate["record-smoke"].set()  # the write in progress finishes
    time.sleep(0.3)
    assert not w.started("fill-canary")
    beside.launched()  # the next stage launched
    _until(lambda: w.started("fill-canary"))
    beside.settle()


def test_a_hold_ends_by_itself_so_a_long_wait_between_stages_does_not_keep_the_writes(monkeypatch):
    monkeypatch.setattr(pipeline, "HOLD_S", 0.3)
    beside, w = Beside(), Writes()
    w.gate["first"] = threading.Event()
    beside.after_next_launch(w.write("first"))
    beside.after_next_launch(w.write("second"))
    beside.launched()
    _until(lambda: w.started("first"))
    beside.hold()  # and no launch follows: a pause, a restart's backoff, a queue
    held_at = time.monotonic()
    w.gate["first"].set()
    _until(lambda: w.started("second"))
    assert w.spans["second"][0] - held_at >= 0.25
    beside.settle()


def test_settle_runs_what_waits_and_raises_a_failure_after_the_rest_ran():
    beside, w = Beside(), Writes()
    beside.after_next_launch(w.write("identity", fail=True))
    beside.after_next_launch(w.write("record"))
    beside.hold()  # a hold does not keep settle waiting
    with pytest.raises(RuntimeError, match="identity failed"):
        beside.settle()
    assert w.started("record")
    beside.settle()  # raised once: nothing left


def test_writes_kept_after_a_settle_get_a_writer_again():
    beside, w = Beside(), Writes()
    beside.after_next_launch(w.write("first"))
    beside.settle()
    beside.after_next_launch(w.write("second"))
    beside.launched()
    _until(lambda: w.started("second"))
    beside.settle()
    _until(lambda: not [t for t in threading.enumerate() if t.name == "ladder-beside-writes"])  # none left waiting


def test_settling_the_writes_leaves_a_call_in_a_thread_to_the_next_settle():
    """The run's end: the stages' records are settled before the promotion reads them, while the last stage's
    report (an API call in a thread) goes on beside the promotion until the run's last settle."""
    beside, w = Beside(), Writes()
    report_may_end, report_ended = threading.Event(), threading.Event()

    def report() -> None:
        assert report_may_end.wait(10)
        report_ended.set()

    beside.thread(report)
    beside.after_next_launch(w.write("record-full", seconds=0.05))
    beside.settle(writes_only=True)
    assert len(w.spans["record-full"]) == 2  # the record has ended...
    assert not report_ended.is_set()  # ...and the report still runs
    settled = threading.Thread(target=beside.settle)
    settled.start()
    time.sleep(0.1)
    assert settled.is_alive()  # the last settle waits for it
    report_may_end.set()
    settled.join(5)
    assert not settled.is_alive() and report_ended.is_set()
