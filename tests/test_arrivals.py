"""Two transfers of one copy at once (a restore's pull and a re-replication's push of the
same step, seen on a Cluster under load): the second waits for the first to land and
takes it, instead of replacing it and breaking the first off ("deleted while it arrived")."""

import os
import threading

import numpy as np

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.protos.checksum import checksum
from bubblesnap.service.store import arrivals
from bubblesnap.service.store.layout import build_layout


def test_a_second_transfer_of_an_arriving_copy_waits_for_it_and_takes_it(store, monkeypatch):
    data = np.arange(1024, dtype=np.float32)
    layout = build_layout([pb.TensorSpec(name="w", dtype="float32", global_shape=[1024], shards=[
        pb.ShardSpec(index=[pb.Slice(start=0, stop=1024)], nbytes=data.nbytes, device="host")])])
    sums = [checksum(data.tobytes())]
    first_filling, second_waits = threading.Event(), threading.Event()
    reserve = arrivals.reserve

    def seen_reserve(*args, **kwargs):  # tells when the second transfer found the first
        try:
            return reserve(*args, **kwargs)
        except arrivals.ArrivingAlready:
            second_waits.set()
            raise
    monkeypatch.setattr(arrivals, "reserve", seen_reserve)

    def slow_fill(view, slots):  # the first transfer: its bytes come slowly
        first_filling.set()
        assert second_waits.wait(10), "the second transfer did not wait for this one"
        for offset, nbytes in slots:
            view[offset:offset + nbytes] = data.view(np.uint8)
        return None

    def fill(view, slots):
        for offset, nbytes in slots:
            view[offset:offset + nbytes] = data.view(np.uint8)
        return None

    outcomes = {}
    first = threading.Thread(target=lambda: outcomes.setdefault(
        "first", store.install("job", 1, 0, 3, layout, sums, slow_fill, for_restore=True)))
    first.start()
    assert first_filling.wait(10)
    second = threading.Thread(target=lambda: outcomes.setdefault(
        "second", store.install("job", 1, 0, 3, layout, sums, fill)))
    second.start()
    first.join(10)
    second.join(10)
    # the first landed it (bytes stored); the second found it held (0 more bytes)
    assert outcomes == {"first": data.nbytes, "second": 0}


def test_a_restores_segment_being_filled_outlives_another_restore_of_the_rank(store):
    """Two restores of one rank at once (a retry while the first still runs): the second
    one's release leaves the segment the first is filling; the next release frees it."""
    segments = store.restore_segments
    with segments.served("job", 0, 1 << 20) as first:
        segments.release("job", 0)  # the second restore begins
        first.view[:] = 7  # still mapped, still in the budget
        assert os.path.exists(first.path) and store.memory().used_bytes >= 1 << 20
    segments.release("job", 0)
    assert not os.path.exists(first.path) and store.memory().used_bytes == 0
