"""Job-wide arrays on a real daemon, over raw gRPC: coverage at registration, commit only
when whole, restore by regions gathered from several ranks' copies, epochs."""

import mmap

import grpc
import numpy as np
import pytest

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.protos.checksum import checksum
from bubblesnap.service.errors import FailedPrecondition
from bubblesnap.service.restore.region_plan import Asked, plan
from bubblesnap.service.store.layout import build_layout
from bubblesnap.testing import wait_for

C = grpc.StatusCode
GLOBAL = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)


def spec(name, box, shape=(8, 6), dtype="float32", job_wide=True, boxes=None):
    boxes = [box] if boxes is None else boxes
    itemsize = np.dtype(dtype).itemsize
    return pb.TensorSpec(name=name, dtype=dtype, global_shape=shape, job_wide=job_wide, shards=[
        pb.ShardSpec(index=[pb.Slice(start=a, stop=b) for a, b in b_],
                     nbytes=int(np.prod([b - a for a, b in b_])) * itemsize) for b_ in boxes])


def register(stub, job, rank, world, tensors):
    return stub.Register(pb.RegisterRequest(job=job, rank=rank, world_size=world,
                                            tensors=tensors), timeout=10)


def snapshot(stub, job, rank, step, arrays):
    """Writes ``arrays`` (one per slot, in slot order) into a step and commits it."""
    staging = stub.BeginStep(pb.BeginStepRequest(job=job, rank=rank, step=step), timeout=10)
    with open(staging.segment_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        for slot, array in zip(staging.slots, arrays, strict=True):
            m[slot.offset:slot.offset + slot.nbytes] = np.ascontiguousarray(array).tobytes()
    return stub.CommitStep(pb.CommitStepRequest(job=job, rank=rank, step=step), timeout=10)


def restore(stub, job, rank, world, asked, step=None, **fields):
    request = pb.RestoreRequest(job=job, rank=rank, world_size=world, **fields, tensors=[
        pb.TensorRequest(name=name, dtype=dtype, global_shape=shape, regions=[
            pb.Region(index=[pb.Slice(start=a, stop=b) for a, b in box]) for box in boxes])
        for name, dtype, shape, boxes in asked])
    if step is not None:
        request.step = step
    answer = stub.Restore(request, timeout=30)
    return answer, read_answer(answer)


def read_answer(answer) -> dict:
    """(tensor name, region) -> the region's array, each slot read from its segment."""
    paths = [answer.segment_path, *answer.other_segments]
    got = {}
    for slot in answer.slots:
        t = answer.tensors[slot.tensor]
        box = [(s.start, s.stop) for s in t.shards[slot.shard].index]
        with open(paths[slot.segment], "rb") as f:
            f.seek(slot.offset)
            got[(t.name, slot.shard)] = np.frombuffer(f.read(slot.nbytes), dtype=t.dtype
                                                      ).reshape([b - a for a, b in box])
    return got


def code_of(call, *args):
    with pytest.raises(grpc.RpcError) as info:
        call(*args)
    return info.value.code(), info.value.details()


def two_rank_job(daemon, job="wide", steps=(0,)):
    """Rank 0 copies rows 0:4 of 'w', rank 1 rows 4:8; 's' is a scalar rank 0 copies."""
    register(daemon.stub, job, 0, 2, [spec("w", ((0, 4), (0, 6))),
                                      spec("s", (), shape=(), dtype="int32")])
    register(daemon.stub, job, 1, 2, [spec("w", ((4, 8), (0, 6))),
                                      spec("s", None, shape=(), dtype="int32", boxes=[])])
    for step in steps:
        first = snapshot(daemon.stub, job, 0, step, [GLOBAL[0:4] + step, np.int32(step)])
        assert not first.job_committed  # rank 1's rows are missing
        assert snapshot(daemon.stub, job, 1, step, [GLOBAL[4:8] + step]).job_committed


def test_registrations_that_can_never_cover_are_refused(daemon):
    register(daemon.stub, "gap", 0, 2, [spec("w", ((0, 4), (0, 6)))])
    got, details = code_of(register, daemon.stub, "gap", 1, 2, [spec("w", ((0, 4), (0, 6)))])
    assert got == C.FAILED_PRECONDITION and "'w' [4:8, 0:6]" in details, details
    got, details = code_of(register, daemon.stub, "gap", 1, 2,
                           [spec("w", ((4, 8), (0, 6)), dtype="int32")])
    assert got == C.FAILED_PRECONDITION and "'w' is declared float32" in details, details
    register(daemon.stub, "gap", 1, 2, [spec("w", ((4, 8), (0, 6)))])  # nothing was kept
    job = daemon.stub.Status(pb.StatusRequest(job="gap"), timeout=10).jobs[0]
    assert list(job.registered_ranks) == [0, 1]
    # A rank's own tensor must be covered by its own shards.
    got, details = code_of(register, daemon.stub, "own", 0, 1,
                           [spec("v", ((0, 4), (0, 6)), job_wide=False)])
    assert got == C.FAILED_PRECONDITION and "'v' [4:8, 0:6]" in details, details


def test_regions_are_gathered_from_every_ranks_copy(daemon):
    two_rank_job(daemon, steps=(0, 1))
    # Another mesh: columns split in two, and the whole array once.
    asked = [("w", "float32", (8, 6), [((0, 8), (0, 3)), ((0, 8), (3, 6)), ((0, 8), (0, 6))]),
             ("s", "int32", (), [()])]
    answer, got = restore(daemon.stub, "wide", 0, 1, asked)
    assert answer.step == 1 and answer.world_size == 2
    assert (got[("w", 0)] == GLOBAL[:, 0:3] + 1).all()
    assert (got[("w", 1)] == GLOBAL[:, 3:6] + 1).all()
    assert (got[("w", 2)] == GLOBAL + 1).all()
    assert got[("s", 0)] == 1
    assert list(answer.checksums) == [checksum(a.reshape(-1).view(np.uint8))
                                      for a in got.values()]
    # A caller that checks no checksum gets the same bytes, the cut regions not hashed.
    unhashed, same = restore(daemon.stub, "wide", 0, 1, asked, skip_answer_checksums=True)
    assert {k: a.tobytes() for k, a in same.items()} == {k: a.tobytes() for k, a in got.items()}
    assert list(unhashed.checksums) == [0] * len(got)
    # A region inside one rank's shard, and one across both.
    _, got = restore(daemon.stub, "wide", 1, 2, [("w", "float32", (8, 6),
                                                  [((5, 7), (1, 2)), ((3, 5), (2, 6))])],
                     step=0)
    assert (got[("w", 0)] == GLOBAL[5:7, 1:2]).all() and (got[("w", 1)] == GLOBAL[3:5, 2:6]).all()


def test_a_copy_that_fails_its_checksum_is_never_cut_into_a_restore(daemon):
    two_rank_job(daemon, steps=())
    snapshot(daemon.stub, "wide", 0, 0, [GLOBAL[0:4], np.int32(0)])
    staging = daemon.stub.BeginStep(pb.BeginStepRequest(job="wide", rank=1, step=0), timeout=10)
    with open(staging.segment_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[staging.slots[0].offset:staging.slots[0].offset + staging.slots[0].nbytes] = \
            GLOBAL[4:8].tobytes()
        daemon.stub.CommitStep(pb.CommitStepRequest(job="wide", rank=1, step=0), timeout=10)
        m[staging.slots[0].offset + 5] ^= 0x10  # a bit flips in host memory
    got, details = code_of(restore, daemon.stub, "wide", 0, 1,
                           [("w", "float32", (8, 6), [((0, 8), (0, 3))])])
    assert got == C.DATA_LOSS and "rank 1: slot 0 failed its checksum in memory" in details
    status = daemon.stub.Status(pb.StatusRequest(job="wide"), timeout=10).jobs[0]
    assert [(c.rank, c.step, c.source) for c in status.corrupt_copies] == [(1, 0, "memory")]
    # the intact copy is still served: rank 0's own rows
    _, rows = restore(daemon.stub, "wide", 0, 2, [("w", "float32", (8, 6), [((0, 4), (0, 6))])])
    assert (rows[("w", 0)] == GLOBAL[0:4]).all()


def test_a_held_copy_that_fails_while_it_is_cut_gives_way_to_a_peers_replica(start_ring):
    # Held copies are verified in the pass that cuts them: a flipped bit found there
    # throws that answer away, and the restore reads again, each copy checked first, so
    # the copy is recorded as corrupt and the peer's intact replica serves its rows.
    a = start_ring(2, "--replicas", "1").daemons[0]
    two_rank_job(a, steps=())
    snapshot(a.stub, "wide", 0, 0, [GLOBAL[0:4], np.int32(0)])
    staging = a.stub.BeginStep(pb.BeginStepRequest(job="wide", rank=1, step=0), timeout=10)
    slot = staging.slots[0]
    with open(staging.segment_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[slot.offset:slot.offset + slot.nbytes] = GLOBAL[4:8].tobytes()
        a.stub.CommitStep(pb.CommitStepRequest(job="wide", rank=1, step=0), timeout=10)
        wait_for(lambda: a.stub.Status(pb.StatusRequest(job="wide"), timeout=10)
                 .jobs[0].latest_committed_step == 0, "step 0 committed, replicated")
        m[slot.offset + 5] ^= 0x10  # a bit flips in host memory
    answer, got = restore(a.stub, "wide", 0, 1, [("w", "float32", (8, 6), [((0, 8), (0, 3))])])
    assert (got[("w", 0)] == GLOBAL[:, 0:3]).all() and answer.source == "memory, peer"
    status = a.stub.Status(pb.StatusRequest(job="wide"), timeout=10).jobs[0]
    assert [(c.rank, c.step, c.source) for c in status.corrupt_copies] == [(1, 0, "memory")]


def test_a_rank_asking_for_its_own_shards_gets_its_copy_as_it_is(daemon):
    two_rank_job(daemon)
    used = daemon.stub.Status(pb.StatusRequest(), timeout=10).memory.used_bytes
    answer, got = restore(daemon.stub, "wide", 1, 2,
                          [("w", "float32", (8, 6), [((4, 8), (0, 6))])])
    assert (got[("w", 0)] == GLOBAL[4:8]).all()
    # no segment was assembled: the copy itself was handed over
    assert daemon.stub.Status(pb.StatusRequest(), timeout=10).memory.used_bytes == used
    assert answer.source == "memory"


def test_what_a_restore_by_regions_refuses(daemon):
    two_rank_job(daemon)
    cases = [
        ([("x", "float32", (8, 6), [((0, 1), (0, 1))])], C.NOT_FOUND, "no tensor 'x'"),
        ([("w", "float32", (8, 7), [((0, 1), (0, 1))])], C.FAILED_PRECONDITION,
         "saved as float32[8, 6]"),
        ([("w", "float32", (8, 6), [((0, 9), (0, 1))])], C.INVALID_ARGUMENT, "[0, 9)"),
        ([("w", "float32", (8, 6), [((0, 1),)])], C.INVALID_ARGUMENT, "index dimensions"),
        ([("w", "bfloat17", (8, 6), [((0, 1), (0, 1))])], C.INVALID_ARGUMENT, "dtype"),
    ]
    for asked, code, words in cases:
        got, details = code_of(restore, daemon.stub, "wide", 0, 1, asked)
        assert got == code and words in details, (asked, got, details)
    # the held copies are untouched
    _, got = restore(daemon.stub, "wide", 0, 2, [("w", "float32", (8, 6), [((0, 8), (0, 6))])])
    assert (got[("w", 0)] == GLOBAL).all()


def test_a_ranks_own_state_restores_only_into_its_world_size(daemon):
    register(daemon.stub, "mpmd", 0, 2, [spec("p", ((0, 8), (0, 6)), job_wide=False)])
    register(daemon.stub, "mpmd", 1, 2, [spec("p", ((0, 2), (0, 6)), shape=(2, 6),
                                              job_wide=False)])
    snapshot(daemon.stub, "mpmd", 0, 0, [GLOBAL])
    snapshot(daemon.stub, "mpmd", 1, 0, [GLOBAL[:2] * 2])
    _, got = restore(daemon.stub, "mpmd", 1, 2, [("p", "float32", (2, 6), [((0, 2), (0, 6))])])
    assert (got[("p", 0)] == GLOBAL[:2] * 2).all()  # rank 1's own 'p', not rank 0's
    got, details = code_of(restore, daemon.stub, "mpmd", 0, 1,
                           [("p", "float32", (8, 6), [((0, 8), (0, 6))])])
    assert got == C.FAILED_PRECONDITION and "restores only into 2 ranks, not 1" in details
    got, details = code_of(daemon.stub.Restore, pb.RestoreRequest(job="mpmd", rank=0,
                                                                  world_size=1))
    assert got == C.FAILED_PRECONDITION and "taken by 2 ranks" in details, details


def test_after_a_restore_under_another_world_size_the_job_goes_on_as_a_new_epoch(daemon):
    two_rank_job(daemon, steps=(0, 1))
    one = [spec("w", ((0, 8), (0, 6))), spec("s", (), shape=(), dtype="int32")]
    got, details = code_of(register, daemon.stub, "wide", 0, 1, one)
    assert got == C.FAILED_PRECONDITION and "restore the job first" in details
    restore(daemon.stub, "wide", 0, 1, [("w", "float32", (8, 6), [((0, 8), (0, 6))])])
    register(daemon.stub, "wide", 0, 1, one)
    assert snapshot(daemon.stub, "wide", 0, 2, [GLOBAL * 10, np.int32(2)]).job_committed
    job = daemon.stub.Status(pb.StatusRequest(job="wide"), timeout=10).jobs[0]
    assert job.world_size == 1 and [s.step for s in job.steps if s.committed] == [1, 2]
    # the older epoch's step is still restorable, into either world size
    _, got = restore(daemon.stub, "wide", 0, 1,
                     [("w", "float32", (8, 6), [((2, 6), (0, 6))])], step=1)
    assert (got[("w", 0)] == GLOBAL[2:6] + 1).all()
    _, got = restore(daemon.stub, "wide", 0, 1,
                     [("w", "float32", (8, 6), [((0, 8), (0, 6))])])
    assert (got[("w", 0)] == GLOBAL * 10).all()


def test_the_plan_takes_one_shard_when_one_holds_the_region():
    layouts = {0: build_layout([spec("w", ((0, 4), (0, 6)))]),
               1: build_layout([spec("w", ((4, 8), (0, 6)))])}
    whole = plan([Asked("w", "float32", (8, 6), (((0, 8), (0, 6)),))], layouts, 2, 0, 1)
    assert [(p.rank, p.box) for p in whole.pieces[0][0]] == [(0, ((0, 4), (0, 6))),
                                                             (1, ((4, 8), (0, 6)))]
    inside = plan([Asked("w", "float32", (8, 6), (((5, 6), (0, 6)),))], layouts, 2, 0, 1)
    assert [p.rank for p in inside.pieces[0][0]] == [1] and inside.exact_copy() is None
    own = plan([Asked("w", "float32", (8, 6), (((4, 8), (0, 6)),))], layouts, 2, 1, 2)
    assert own.exact_copy() == 1


def test_shards_that_tile_a_tensor_plan_as_the_gap_walk_would_and_gaps_are_refused():
    # rows held, columns asked (a reshard): the shards tile the tensor, so no gap is looked
    # for; the pieces are those the walk would plan
    rows = {0: build_layout([spec("w", ((0, 4), (0, 6)))]),
            1: build_layout([spec("w", ((4, 8), (0, 6)))])}
    columns = plan([Asked("w", "float32", (8, 6), (((0, 8), (0, 3)), ((0, 8), (3, 6))))],
                   rows, 2, 0, 1)
    assert [[(p.rank, p.box) for p in region] for region in columns.pieces[0]] == [
        [(0, ((0, 4), (0, 3))), (1, ((4, 8), (0, 3)))],
        [(0, ((0, 4), (3, 6))), (1, ((4, 8), (3, 6)))]]
    # overlapping shards whose volumes add up to the tensor's still leave rows 6:8 bare
    overlapping = {0: build_layout([spec("w", ((0, 5), (0, 6)))]),
                   1: build_layout([spec("w", ((3, 6), (0, 6)))])}
    with pytest.raises(FailedPrecondition, match=r"no copy of the step holds 'w' \[6:8, 0:3\]"):
        plan([Asked("w", "float32", (8, 6), (((0, 8), (0, 3)),))], overlapping, 2, 0, 1)


def test_a_ring_judges_coverage_and_gathers_regions_from_a_peer(start_ring):
    ring = start_ring(2, "--replicas", "0")  # each rank's only copy is on its own host
    a, b = ring.daemons
    register(a.stub, "ring", 0, 2, [spec("w", ((0, 4), (0, 6)))])

    def refused():  # b judges with rank 0's layout, asked of a
        try:
            register(b.stub, "ring", 1, 2, [spec("w", ((0, 4), (0, 6)))])
        except grpc.RpcError as err:
            assert err.code() == C.FAILED_PRECONDITION and "'w' [4:8, 0:6]" in err.details()
            return True
        # a did not answer yet (just started): b could not judge; try again
        b.stub.DeleteSnapshots(pb.DeleteSnapshotsRequest(job="ring"), timeout=10)
        return False

    wait_for(refused, "peers' layouts judged at registration")
    register(b.stub, "ring", 1, 2, [spec("w", ((4, 8), (0, 6)))])
    snapshot(a.stub, "ring", 0, 0, [GLOBAL[0:4]])
    snapshot(b.stub, "ring", 1, 0, [GLOBAL[4:8]])
    wait_for(lambda: a.stub.Status(pb.StatusRequest(job="ring"), timeout=10)
             .jobs[0].latest_committed_step == 0, "step 0 committed by the group")
    # status judges coverage from every daemon's ranks (a view at most a second old)
    wait_for(lambda: a.stub.Status(pb.StatusRequest(job="ring"), timeout=10)
             .jobs[0].coverage.whole, "coverage of the ring's ranks shown whole")
    answer, got = restore(a.stub, "ring", 0, 1, [("w", "float32", (8, 6), [((2, 7), (1, 5))])])
    assert (got[("w", 0)] == GLOBAL[2:7, 1:5]).all()
    assert answer.source == "memory, peer"


WIDE = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)  # a row: 64 bytes


def ring_of_rows(ring):
    """Rank 0 of job 'rows' on daemon 0 holds rows 0:4 of 'w', rank 1 on daemon 1 rows
    4:8 (256 bytes each); step 0 committed. Daemon 0, and rank 1's BeginStep answer."""
    a, b = ring.daemons
    for daemon, rank in ((a, 0), (b, 1)):
        box = ((4 * rank, 4 * rank + 4), (0, 16))
        wait_for(lambda d=daemon, r=rank, x=box: _registered(d, r, x), "registered")
    snapshot(a.stub, "rows", 0, 0, [WIDE[0:4]])
    staging = b.stub.BeginStep(pb.BeginStepRequest(job="rows", rank=1, step=0), timeout=10)
    with open(staging.segment_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[staging.slots[0].offset:staging.slots[0].offset + 256] = WIDE[4:8].tobytes()
    b.stub.CommitStep(pb.CommitStepRequest(job="rows", rank=1, step=0), timeout=10)
    wait_for(lambda: a.stub.Status(pb.StatusRequest(job="rows"), timeout=10)
             .jobs[0].latest_committed_step == 0, "step 0 committed by the group")
    return a, staging


def _registered(daemon, rank, box) -> bool:
    try:
        register(daemon.stub, "rows", rank, 2, [spec("w", box, shape=(8, 16))])
        return True
    except grpc.RpcError as err:  # the other daemon's layout not seen yet
        daemon.stub.DeleteSnapshots(pb.DeleteSnapshotsRequest(job="rows"), timeout=10)
        assert err.code() == C.FAILED_PRECONDITION, err.details()
        return False


def test_a_peers_copy_pulled_to_be_cut_is_checked_before_it_is_used(start_ring):
    a, held = ring_of_rows(start_ring(2, "--replicas", "0"))
    answer, got = restore(a.stub, "rows", 0, 1, [("w", "float32", (8, 16), [((3, 5), (0, 16))])])
    assert (got[("w", 0)] == WIDE[3:5]).all() and answer.source == "memory, peer"
    with open(held.segment_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[held.slots[0].offset + 70] ^= 0x01  # a bit flips in b's memory
    used = a.stub.Status(pb.StatusRequest(), timeout=10).memory.used_bytes
    code, details = code_of(restore, a.stub, "rows", 0, 1,
                            [("w", "float32", (8, 16), [((3, 5), (0, 16))])])
    assert code == C.DATA_LOSS and "slot 0 does not match its checksum" in details, details
    # nothing of the restore that failed stays (neither the segment the copy was pulled
    # into nor its answer's), and it freed the previous answer (128 bytes) as any next
    # restore of the rank does
    assert a.stub.Status(pb.StatusRequest(), timeout=10).memory.used_bytes == used - 128
    status = a.stub.Status(pb.StatusRequest(job="rows"), timeout=10).jobs[0]
    assert [(c.rank, c.step) for c in status.corrupt_copies] == [(1, 0)]


@pytest.mark.parametrize("budget", [448, 600])
def test_without_room_to_pull_a_peers_whole_copy_the_slots_asked_come_alone(start_ring, budget):
    # Daemon 0's own copy (256 bytes) and the answer (128) fit, not the pulled copy (256)
    # too; at 600 the pulled copy alone would fit beside the own copy, not the answer too.
    a, _ = ring_of_rows(start_ring(2, "--replicas", "0", "--memory-budget", str(budget)))
    answer, got = restore(a.stub, "rows", 0, 1, [("w", "float32", (8, 16), [((3, 5), (0, 16))])])
    assert (got[("w", 0)] == WIDE[3:5]).all() and answer.source == "memory, peer"


def test_regions_come_from_the_durable_tier_when_no_memory_holds_them(start_daemon, tmp_path):
    flags = ("--durable-dir", str(tmp_path / "durable"), "--durable-every-steps", "1")
    first = start_daemon(*flags)
    two_rank_job(first, job="disk")
    wait_for(lambda: 0 in first.stub.Status(pb.StatusRequest(job="disk"), timeout=10)
             .jobs[0].durable_steps, "step 0 written durably")
    first.kill()  # the host is gone with its memory
    fresh = start_daemon(*flags)
    answer, got = restore(fresh.stub, "disk", 0, 1, [
        ("w", "float32", (8, 6), [((0, 8), (0, 3)), ((2, 6), (3, 6))]),
        ("s", "int32", (), [()])])
    assert answer.source == "durable" and answer.world_size == 2
    assert (got[("w", 0)] == GLOBAL[:, 0:3]).all() and (got[("w", 1)] == GLOBAL[2:6, 3:6]).all()
    assert got[("s", 0)] == 0
