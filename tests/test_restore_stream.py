"""RestoreStream: the answer's segment named before its bytes are ready, from every tier.

The client maps the segment while the daemon verifies it, pulls it from a
peer, reads it from disk or cuts a reshard into it. Checked here on real
daemons: the segment is named first, with its size, the answer
then names the same one (or, after a corrupt copy was given up, the one that
replaced it), and the client restores every byte.
"""

import concurrent.futures
import mmap
import pathlib

import grpc
import numpy as np
import pytest

from bubblesnap.clients import ClientOptions, NumpyClient
from bubblesnap.clients._restore_call import AnswerMapping, restore_call
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.protos import daemon_pb2_grpc
from bubblesnap.protos.checksum import checksum
from bubblesnap.testing import wait_for
from tests.test_regions import GLOBAL, code_of, read_answer, snapshot, two_rank_job

JOB = "stream"


def state(rank: int, step: int) -> dict[str, np.ndarray]:
    return {"w": np.arange(4096 * (rank + 1), dtype=np.float32) * (rank + 1) + step,
            "b": np.full((3, 5), rank * 100 + step, dtype=np.int64)}


def client(daemon, rank: int, world: int) -> NumpyClient:
    return NumpyClient(JOB, rank, world, ClientOptions(daemon=daemon.address,
                                                       restore_timeout_seconds=60))


def snapshot_steps(daemons, steps, world: int) -> None:
    clients = [client(daemons[r], r, world) for r in range(world)]
    for step in steps:
        for rank, c in enumerate(clients):
            result = c.snapshot(step, state(rank, step))
            assert result.taken, result.reason
    for c in clients:
        c.close()


def committed(daemon, step: int) -> bool:
    status = daemon.stub.Status(pb.StatusRequest(job=JOB), timeout=10)
    return any(s.step == step and s.committed for s in status.jobs[0].steps)


def copies_held(daemon, step: int) -> dict[int, int]:
    """rank -> the live copies of its ``step`` the group holds, as ``daemon`` sees them."""
    status = daemon.stub.Status(pb.StatusRequest(job=JOB), timeout=10)
    return {r.rank: r.copies for job in status.jobs for s in job.steps if s.step == step
            for r in s.ranks}


def streamed(daemon, request) -> tuple[list[str], pb.RestoreResponse]:
    """The segments named before the answer, and the answer, which must be the last
    message; each segment the answer uses was named with its size. (One named and then
    given up, a corrupt copy, may be gone by the time the test looks.)"""
    named, sizes, answer = [], {}, None
    for update in daemon.stub.RestoreStream(request, timeout=60):
        assert answer is None, "a message after the answer"
        if update.HasField("segment"):
            named.append(update.segment.path)
            sizes[update.segment.path] = update.segment.nbytes
        else:
            answer = update.restored
    assert answer is not None, "the stream ended without an answer"
    for path in (answer.segment_path, *answer.other_segments):
        assert pathlib.Path(path).stat().st_size == sizes[path]
    return named, answer


def assert_restores(daemon, rank: int, step: int, source: str, world: int) -> None:
    c = client(daemon, rank, world)
    got_step, arrays = c.restore()
    assert (got_step, c.last_restore_source) == (step, source)
    for name, expected in state(rank, step).items():
        assert arrays[name].tobytes() == expected.tobytes(), f"rank {rank} {name} differs"
    c.close()


def test_each_tier_names_the_answers_segment_first(start_ring, tmp_path):
    durable = tmp_path / "durable"
    ring = start_ring(3, "--replicas", "1", "--durable-dir", str(durable),
                      "--durable-every-steps", "1")
    snapshot_steps(ring.daemons, range(2), world=2)
    wait_for(lambda: committed(ring.daemons[0], 1), "step 1 committed")

    named, answer = streamed(ring.daemons[0], pb.RestoreRequest(job=JOB, rank=0, alone=True))
    assert (named, answer.source, answer.step) == ([answer.segment_path], "memory", 1)
    assert_restores(ring.daemons[0], 0, 1, "memory", world=2)

    wait_for(lambda: 1 in ring.daemons[0].stub.Status(pb.StatusRequest(job=JOB), timeout=10)
             .jobs[0].durable_steps, "step 1 written durably")
    ring.daemons[1].kill()
    # back to two copies of each rank on the survivors first: the replacement gets none
    wait_for(lambda: copies_held(ring.daemons[0], 1) == {0: 2, 1: 2},
             "both ranks' copies re-replicated on the survivors")
    replacement = ring.replace(1)
    named, answer = streamed(replacement, pb.RestoreRequest(job=JOB, rank=1, alone=True))
    assert (named, answer.source) == ([answer.segment_path], "peer")

    for daemon in (ring.daemons[0], replacement, ring.daemons[2]):
        daemon.kill()
    fresh = ring.replace(0)
    named, answer = streamed(fresh, pb.RestoreRequest(job=JOB, rank=0, alone=True))
    assert (named, answer.source) == ([answer.segment_path], "durable")
    assert_restores(fresh, 0, 1, "memory", world=2)  # installed by the restore before


def rows_2_to_6(world_size: int = 1) -> pb.RestoreRequest:
    """Rows 2:6 of two_rank_job's 'w': half from rank 0's copy, half from rank 1's."""
    return pb.RestoreRequest(job=JOB, rank=0, world_size=world_size, tensors=[pb.TensorRequest(
        name="w", dtype="float32", global_shape=[8, 6],
        regions=[pb.Region(index=[pb.Slice(start=2, stop=6), pb.Slice(start=0, stop=6)])])])


def three_row_blocks() -> pb.RestoreRequest:
    """Rows 0:2, 2:4 and 4:8 of two_rank_job's 'w'."""
    return pb.RestoreRequest(job=JOB, rank=0, world_size=1, tensors=[pb.TensorRequest(
        name="w", dtype="float32", global_shape=[8, 6], regions=[
            pb.Region(index=[pb.Slice(start=a, stop=b), pb.Slice(start=0, stop=6)])
            for a, b in ((0, 2), (2, 4), (4, 8))])])


def test_a_resharded_restore_names_the_segment_it_cuts_into(daemon):
    two_rank_job(daemon, JOB)
    named, answer = streamed(daemon, rows_2_to_6())
    assert named == [answer.segment_path]
    with open(answer.segment_path, "rb") as f:
        f.seek(answer.slots[0].offset)
        got = np.frombuffer(f.read(answer.slots[0].nbytes), dtype=np.float32)
    assert got.tobytes() == GLOBAL[2:6].tobytes()


def test_regions_that_lie_as_one_run_in_a_held_copy_are_answered_where_they_lie(daemon):
    """Rows 0:2 and 4:8 of 'w' lie as one aligned run in rank 0's and rank 1's copies:
    answered as views of those copies' segments. Rows 2:4 start 48 bytes into rank 0's
    shard (an array could not alias it): cut into the answer's own segment."""
    two_rank_job(daemon, JOB)
    named, answer = streamed(daemon, three_row_blocks())
    paths = [answer.segment_path, *answer.other_segments]
    assert sorted(named) == sorted(paths) and len(set(paths)) == 3
    assert [s.segment for s in answer.slots] == [1, 0, 2]  # rank 0's copy, the cut, rank 1's
    got = read_answer(answer)
    for region, (a, b) in enumerate(((0, 2), (2, 4), (4, 8))):
        assert got[("w", region)].tobytes() == GLOBAL[a:b].tobytes()
        assert answer.checksums[region] == checksum(GLOBAL[a:b].tobytes())
    # Restore (not the stream) answers one segment, as its callers read it.
    plain = daemon.stub.Restore(three_row_blocks(), timeout=30)
    assert not plain.other_segments and {s.segment for s in plain.slots} == {0}
    assert [got.tobytes() for got in read_answer(plain).values()] == \
        [GLOBAL[a:b].tobytes() for a, b in ((0, 2), (2, 4), (4, 8))]
    # A copy answered in place is never recycled: deleted, its file is unlinked (not kept
    # for a later step to be staged into), and the client's mapping keeps its bytes.
    with open(paths[1], "rb") as f:
        kept = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    daemon.stub.DeleteSnapshots(pb.DeleteSnapshotsRequest(job=JOB, steps=[0]), timeout=10)
    assert not pathlib.Path(paths[1]).exists() and not pathlib.Path(paths[2]).exists()
    region = answer.slots[0]
    assert kept[region.offset:region.offset + region.nbytes] == GLOBAL[0:2].tobytes()
    kept.close()


def test_runs_of_a_peers_copy_pulled_whole_are_answered_in_the_pulled_segment(start_ring):
    ring = start_ring(3, "--replicas", "1")
    held = ring.daemons[0]
    two_rank_job(held, JOB, steps=())  # registered; committed once replicated:
    snapshot(held.stub, JOB, 0, 0, [GLOBAL[0:4], np.int32(0)])
    snapshot(held.stub, JOB, 1, 0, [GLOBAL[4:8]])
    wait_for(lambda: committed(held, 0), "step 0 committed with both ranks' copies twice")
    ring.daemons[1].kill()
    # The survivors bring both copies back to two before the replacement comes: it gets
    # none of them by re-replication, and restores every byte from its peers.
    wait_for(lambda: copies_held(ring.daemons[2], 0) == {0: 2, 1: 2},
             "both ranks' copies re-replicated to daemon 2")
    replacement = ring.replace(1)
    named, answer = streamed(replacement, three_row_blocks())
    paths = [answer.segment_path, *answer.other_segments]
    assert answer.source == "peer" and sorted(named) == sorted(paths) and len(set(paths)) == 2
    # Rank 1's copy is all one run (rows 4:8): pulled whole and answered in place. Rows
    # 0:2 are a quarter of rank 0's copy: kept for so little, k ranks restoring a
    # quarter each would hold it k times; pulled into a scratch segment and cut.
    assert [s.segment for s in answer.slots] == [0, 0, 1]
    got = read_answer(answer)
    for region, (a, b) in enumerate(((0, 2), (2, 4), (4, 8))):
        assert got[("w", region)].tobytes() == GLOBAL[a:b].tobytes()
        assert answer.checksums[region] == checksum(GLOBAL[a:b].tobytes())
    # The pulled copies go with the answer, at the rank's next restore.
    streamed(replacement, rows_2_to_6())
    assert not any(pathlib.Path(p).exists() for p in paths)


def test_a_corrupt_copy_given_up_names_the_segment_that_replaced_it(start_ring):
    ring = start_ring(2, "--replicas", "1")
    snapshot_steps(ring.daemons, range(1), world=2)
    wait_for(lambda: committed(ring.daemons[0], 0), "step 0 committed with 2 copies")
    # Corrupt daemon 0's own copy of rank 0; daemon 1 holds an intact replica of it.
    first, answer = streamed(ring.daemons[0], pb.RestoreRequest(job=JOB, rank=0, alone=True))
    assert first == [answer.segment_path]
    with open(answer.segment_path, "r+b") as f:
        f.seek(answer.slots[0].offset + 7)
        byte = f.read(1)
        f.seek(answer.slots[0].offset + 7)
        f.write(bytes([byte[0] ^ 0xFF]))
    named, answer = streamed(ring.daemons[0], pb.RestoreRequest(job=JOB, rank=0, alone=True))
    assert answer.source == "peer"
    assert named == [*first, answer.segment_path] and first[0] != answer.segment_path
    assert_restores(ring.daemons[0], 0, 0, "memory", world=2)  # the peer's copy, kept


def test_copies_corrupt_in_a_run_and_in_a_cut_are_each_recorded_once(start_ring):
    """Rows 4:8 lie as a run in rank 1's held copy: checked up front, it fails and its
    replica on the peer serves. Rows 1:3 are cut from rank 0's: checked in the cut, it
    fails there and the restore reads again, rank 0's copy checked first; rank 1's,
    found corrupt already, is neither read nor recorded again."""
    a = start_ring(2, "--replicas", "1").daemons[0]
    two_rank_job(a, JOB, steps=())
    held = {}
    for rank, arrays in ((0, [GLOBAL[0:4], np.int32(0)]), (1, [GLOBAL[4:8]])):
        staging = a.stub.BeginStep(pb.BeginStepRequest(job=JOB, rank=rank, step=0), timeout=10)
        with open(staging.segment_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            for slot, array in zip(staging.slots, arrays, strict=True):
                m[slot.offset:slot.offset + slot.nbytes] = np.asarray(array).tobytes()
        a.stub.CommitStep(pb.CommitStepRequest(job=JOB, rank=rank, step=0), timeout=10)
        held[rank] = (staging.segment_path, staging.slots[0].offset)
    wait_for(lambda: committed(a, 0), "step 0 committed with both ranks' copies twice")
    for path, offset in held.values():
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            m[offset + 5] ^= 0x10  # a bit flips in host memory
    request = pb.RestoreRequest(job=JOB, rank=0, world_size=1, tensors=[pb.TensorRequest(
        name="w", dtype="float32", global_shape=[8, 6], regions=[
            pb.Region(index=[pb.Slice(start=a, stop=b), pb.Slice(start=0, stop=6)])
            for a, b in ((1, 3), (4, 8))])])
    _, answer = streamed(a, request)
    got = read_answer(answer)
    assert got[("w", 0)].tobytes() == GLOBAL[1:3].tobytes()
    assert got[("w", 1)].tobytes() == GLOBAL[4:8].tobytes() and answer.source == "peer"
    status = a.stub.Status(pb.StatusRequest(job=JOB), timeout=10).jobs[0]
    assert sorted((c.rank, c.step, c.source) for c in status.corrupt_copies) == \
        [(0, 0, "memory"), (1, 0, "memory")]


def test_bad_input_over_the_stream_gets_its_code_and_the_daemon_keeps_serving(daemon):
    two_rank_job(daemon, JOB)

    def call(request):
        return list(daemon.stub.RestoreStream(request, timeout=10))

    assert code_of(call, pb.RestoreRequest(job="ghost", rank=0))[0] == grpc.StatusCode.NOT_FOUND
    got, details = code_of(call, pb.RestoreRequest(job=JOB, rank=-1))
    assert got == grpc.StatusCode.INVALID_ARGUMENT and "rank" in details, details
    raw = daemon.channel.unary_stream("/bubblesnap.v1.Daemon/RestoreStream")
    got, details = code_of(lambda payload: list(raw(payload, timeout=10)), b"\xff\xff")
    assert got == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "malformed bubblesnap.v1.RestoreRequest" in details
    named, answer = streamed(daemon, rows_2_to_6())
    assert named == [answer.segment_path]


def test_the_client_reads_the_early_mappings_the_answer_names(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(bytes(range(256)) * 16)
    b.write_bytes(bytes(4096))
    mapping = AnswerMapping()
    mapping.early(str(tmp_path / "gone"))  # not there (yet): left to the answer
    mapping.early(str(a))
    early = mapping._views[str(a)]
    views = mapping.answer([str(b), str(a)])
    assert views[1] is early and views[1][255] == 255 and views[0][255] == 0
    assert mapping._views == {}  # nothing kept for the next restore
    with pytest.raises(FileNotFoundError):
        mapping.answer([str(tmp_path / "gone")])


def test_a_daemon_without_restore_stream_is_asked_with_restore(daemon):
    """An older daemon answers RestoreStream UNIMPLEMENTED: the client asks Restore."""
    two_rank_job(daemon, JOB)
    upstream = daemon.channel.unary_unary("/bubblesnap.v1.Daemon/Restore")
    older = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    older.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "bubblesnap.v1.Daemon", {"Restore": grpc.unary_unary_rpc_method_handler(
            lambda raw, context: upstream(raw, timeout=30))}),))
    port = older.add_insecure_port("127.0.0.1:0")
    older.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            found, segments, _ = restore_call(daemon_pb2_grpc.DaemonStub(channel),
                                              three_row_blocks(), ClientOptions())
    finally:
        older.stop(None)
    assert len(segments) == 1 and not found.other_segments
    assert segments[0][found.slots[2].offset:][:found.slots[2].nbytes].tobytes() == \
        GLOBAL[4:8].tobytes()
