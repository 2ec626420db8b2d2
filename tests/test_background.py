"""The coalescing worker the replicator and the durable tier run on, with real threads."""

import threading
import time

from bubblesnap.service.background import CoalescingWorker


def _wait(check, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_what_arrives_while_busy_comes_as_one_batch():
    batches, release = [], threading.Event()

    def work(batch):
        batches.append({k: list(v) for k, v in batch.items()})
        release.wait(10)

    worker = CoalescingWorker("t", work)
    worker.start()
    worker.submit("a", 1)
    _wait(lambda: batches)
    for step in (2, 3):
        worker.submit("a", step)
    worker.submit("b", 7)
    release.set()
    _wait(lambda: len(batches) == 2)
    assert batches == [{"a": [1]}, {"a": [2, 3], "b": [7]}]
    assert worker.stop(5)


def test_dropped_and_stopped_items_are_discarded_and_errors_do_not_end_it():
    discarded, worked, busy = [], [], threading.Event()

    def work(batch):
        worked.append(batch)
        if len(worked) == 1:
            raise RuntimeError("a bug")  # logged; the next batch still runs
        busy.wait(10)

    worker = CoalescingWorker("t", work, discard=discarded.append)
    worker.start()
    worker.submit("a", 0)
    _wait(lambda: len(worked) == 1)
    worker.submit("a", 1)
    _wait(lambda: len(worked) == 2)  # busy in the second batch
    for step in (2, 3, 4):
        worker.submit("a", step)
    worker.drop(lambda key, step: step <= 2)
    assert discarded == [3, 4]
    busy.set()
    _wait(lambda: len(worked) == 3)
    assert worked[2] == {"a": [2]}
    busy.clear()
    worker.submit("b", 9)
    _wait(lambda: len(worked) == 4)
    worker.submit("b", 10)  # waits behind the busy batch: discarded at stop
    busy.set()
    assert worker.stop(5)
    assert 10 in discarded or {"b": [10]} in worked


def test_the_tick_runs_between_batches():
    ticks = []
    worker = CoalescingWorker("t", lambda batch: None, tick=lambda: ticks.append(1),
                              every_seconds=0.05)
    worker.start()
    _wait(lambda: len(ticks) >= 3)
    assert worker.stop(5)
