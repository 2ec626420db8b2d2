"""A held copy handed over to a trainer is verified outside the store's lock, pinned: other
calls go on while it is hashed, and a copy deleted or corrupted meanwhile is not served."""

import os
import threading

import numpy as np
import pytest

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.protos.checksum import checksum
from bubblesnap.service.errors import DataLoss, NotFound
from bubblesnap.service.store import SnapshotStore
from bubblesnap.service.store.layout import build_layout
from bubblesnap.service.store.state import StoreState

DATA = np.arange(1024, dtype=np.float32)
STEP = 3


def _committed(store: SnapshotStore) -> tuple[str, int]:
    """Commits step STEP of rank 0 (DATA); returns its segment's path and the slot's offset."""
    layout = build_layout([pb.TensorSpec(name="w", dtype="float32", global_shape=[1024], shards=[
        pb.ShardSpec(index=[pb.Slice(start=0, stop=1024)], nbytes=DATA.nbytes, device="host")])])
    store.register("job", 0, 1, layout, (0,))
    staging = store.begin_step("job", 0, STEP)
    _write(staging.segment_path, staging.slots[0][2], DATA.view(np.uint8))
    store.commit_step("job", 0, STEP, [checksum(DATA.tobytes())])
    return staging.segment_path, staging.slots[0][2]


def _write(path: str, offset: int, data: np.ndarray) -> None:
    segment = np.memmap(path, dtype=np.uint8, mode="r+")
    segment[offset:offset + data.nbytes] = data
    segment.flush()
    del segment


def _while_verified(monkeypatch, call) -> dict:
    """Makes the store's first hash run ``call`` on another thread first and wait (10 s at
    most) for it to end; the dict gets its result, or the exception it raised."""
    outcome = {}
    hash_slots = StoreState.hash

    def run():
        try:
            outcome["result"] = call()
        except Exception as err:
            outcome["raised"] = err

    def hash_after_call(state, segment, slots):
        if "started" not in outcome:
            outcome["started"] = True
            thread = threading.Thread(target=run)
            thread.start()
            thread.join(10)
            assert not thread.is_alive(), "a call made while a copy was verified waited"
        return hash_slots(state, segment, slots)
    monkeypatch.setattr(StoreState, "hash", hash_after_call)
    return outcome


def test_other_calls_go_on_while_a_copy_handed_to_a_trainer_is_verified(store, monkeypatch):
    path, _ = _committed(store)
    outcome = _while_verified(monkeypatch, store.holdings)
    served = store.serve("job", 0, STEP)
    assert (served.step, served.segment_path) == (STEP, path)
    assert [(c.rank, c.step) for c in outcome["result"]] == [(0, STEP)]


def test_a_copy_deleted_while_it_is_verified_is_not_served_and_its_memory_is_freed(
        store, monkeypatch):
    path, _ = _committed(store)
    outcome = _while_verified(monkeypatch, lambda: store.delete("job", [STEP]))
    with pytest.raises(NotFound, match=f"step {STEP} of rank 0 was deleted while it was "
                                       "being verified"):
        store.serve("job", 0, STEP)
    assert outcome["result"] == 1
    # freed at the restore's unpin, unlinked (a trainer may map it), not pooled
    assert not os.path.exists(path)
    memory = store.memory()
    assert (memory.used_bytes, memory.pooled_bytes) == (0, 0)


def test_a_copy_corrupted_before_its_verify_is_discarded(store, monkeypatch):
    path, offset = _committed(store)
    _while_verified(monkeypatch, lambda: _write(path, offset, np.full(4, 255, np.uint8)))
    with pytest.raises(DataLoss, match=f"step {STEP} of rank 0 failed its checksum on"):
        store.serve("job", 0, STEP)
    assert store.holdings() == [] and not os.path.exists(path)
    assert store.memory().used_bytes == 0


def test_two_restores_of_a_corrupt_copy_at_once_are_both_told_it_is_corrupt(
        store, monkeypatch):
    """Members of a replica group restore their copier's one copy: the second to finish
    its verify finds the copy discarded by the first, and still hears why."""
    path, offset = _committed(store)
    _write(path, offset, np.full(4, 255, np.uint8))
    outcome = _while_verified(monkeypatch, lambda: store.serve("job", 0, STEP))
    with pytest.raises(DataLoss, match="failed its checksum"):
        store.serve("job", 0, STEP)
    assert isinstance(outcome["raised"], DataLoss), outcome
    assert store.holdings() == [] and store.memory().used_bytes == 0
