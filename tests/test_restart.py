"""A daemon restarted on the --shm-dir of a killed one adopts what it committed, and only that."""

import json
import os
import threading

import grpc
import numpy as np
import pytest

from bubblesnap.cli.status_command import format_status
from bubblesnap.clients import ClientOptions, NumpyClient
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.testing import Ring, wait_for
from tests.helpers import register, tensor_spec

MIB = np.zeros(1 << 18, np.float32)  # 1 MiB a step


def _on(start_daemon, shm: str, *flags: str):
    return start_daemon("--shm-dir", shm, "--log-level", "INFO", *flags, own_shm_dir=False)


def _snapshots(daemon, job: str, steps, **client) -> NumpyClient:
    numpy = NumpyClient(job, options=ClientOptions(daemon=daemon.address), **client)
    for step in steps:
        assert numpy.snapshot(step, {"x": MIB + step}).committed
    return numpy


def _status(daemon) -> pb.StatusResponse:
    return daemon.stub.Status(pb.StatusRequest(), timeout=10)


def _adopted(status) -> set[tuple[str, int, int]]:
    return {(c.job, c.rank, c.step) for c in status.adoption.adopted}


def _records(directory: str) -> dict[tuple[str, int], str]:
    """(job, step) -> the segment path of each record in ``directory``."""
    found = {}
    for name in os.listdir(directory):
        if name.endswith(".meta"):
            with open(os.path.join(directory, name)) as f:
                header = json.loads(f.readline())
            found[(header["job"], header["step"])] = os.path.join(directory, name[:-5])
    return found


def test_a_restarted_daemon_adopts_its_committed_copies_and_drops_the_rest(
        start_daemon, shm_dirs):
    shm = shm_dirs()
    first = _on(start_daemon, shm, "--keep", "2")
    _snapshots(first, "job", range(4))  # steps 2 and 3 held, one freed segment pooled
    stub = first.stub
    stub.BeginStep(pb.BeginStepRequest(job="job", rank=0, step=4), timeout=10)  # unfinished
    left = first.shm_dir
    first.kill()
    assert len(os.listdir(left)) == 1 + 3 + 2  # the lock, 3 segments, 2 records

    second = _on(start_daemon, shm, "--keep", "2")
    status = _status(second)
    assert _adopted(status) == {("job", 0, 2), ("job", 0, 3)}
    assert len(status.adoption.directories) == 1 and not os.path.exists(left)
    assert f"bubblesnap-{second.proc.pid}-" in status.adoption.directories[0]
    assert [f.reason.startswith("no record") for f in status.adoption.dropped] == [True]
    assert status.adoption.adopted_bytes == 2 * MIB.nbytes
    assert status.memory.used_bytes == 2 * MIB.nbytes  # in the budget
    assert status.adoption.seconds > 0

    # A restore before any registration, then the trainer reattaches.
    numpy = NumpyClient("job", options=ClientOptions(daemon=second.address))
    step, restored = numpy.restore()
    assert step == 3 and np.array_equal(restored["x"], MIB + 3)
    again = second.stub.Register(pb.RegisterRequest(
        job="job", rank=0, world_size=1, tensors=[tensor_spec("x", MIB.shape)]), timeout=10)
    assert again.reattached and again.latest_local_step == 3
    with pytest.raises(grpc.RpcError) as refused:
        register(second.stub, "job", tensors=[tensor_spec("y", (4,))])
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS

    # Retention frees the adopted copies like its own: unlinked, out of the budget.
    for step in (4, 5):
        assert numpy.snapshot(step, {"x": MIB + step}).committed
    adopted_dir = status.adoption.directories[0]
    assert sorted(os.listdir(adopted_dir)) == ["lock"]
    assert _status(second).memory.used_bytes == 2 * MIB.nbytes
    numpy.close()
    assert second.stop() == 0
    assert os.listdir(shm) == []
    assert "adopted 2 copies (2.0 MiB) of jobs ['job']" in second.stderr_text()


def test_damaged_copies_are_dropped_and_newer_formats_left_alone(start_daemon, shm_dirs):
    shm = shm_dirs()
    first = _on(start_daemon, shm, "--keep", "2")
    for job in ("a", "b"):
        _snapshots(first, job, range(2)).close()
    records = _records(first.shm_dir)
    first.kill()
    directory = os.path.dirname(records[("a", 0)])
    with open(records[("a", 1)], "r+b") as segment:  # one bit flips in memory
        segment.seek(1000)
        byte = segment.read(1)
        segment.seek(1000)
        segment.write(bytes([byte[0] ^ 1]))
    newer = records[("b", 0)] + ".meta"
    with open(newer) as f:
        header, rest = f.readline(), f.read()
    with open(newer, "w") as f:
        f.write(json.dumps({**json.loads(header), "version": 2}) + "\n" + rest)
    with open(records[("b", 1)] + ".meta", "r+") as f:
        f.truncate(40)  # cannot happen through the rename, but a record is never trusted
    with open(os.path.join(directory, "seg-7.meta.tmp"), "w") as f:
        f.write('{"version": 1, "job"')  # the daemon died writing a record
    with open(os.path.join(directory, "seg-8.meta"), "w") as f:
        f.write(header)  # its segment is gone
    with open(os.path.join(directory, "seg-9.meta"), "w") as f:
        f.write('{"version": 3}\n')  # a newer daemon's, whatever it means
    with open(os.path.join(directory, "future.idx"), "w") as f:
        f.write("a newer daemon's file")

    second = _on(start_daemon, shm)
    adoption = _status(second).adoption
    assert _adopted(_status(second)) == {("a", 0, 0)}
    reasons = {os.path.basename(f.path): f.reason for f in adoption.dropped}
    renamed = adoption.directories[0]
    assert "failed its checksum on 'x' shard 0" in reasons[os.path.basename(records[("a", 1)])]
    assert "unreadable record" in reasons[os.path.basename(records[("b", 1)])]
    assert "cut short" in reasons["seg-7.meta.tmp"]
    assert reasons["seg-8.meta"] == "a record without its segment"
    assert [(os.path.basename(f.path), f.reason.split(";")[0]) for f in adoption.kept] == \
        [("future.idx", "not a file of this daemon's format"),
         (os.path.basename(records[("b", 0)]), "a record of format version 2"),
         ("seg-9.meta", "a record of format version 3")]
    text = format_status(_status(second))
    assert "adopted at start: 1 copies" in text and "kept" in text
    step, restored = NumpyClient("a", options=ClientOptions(daemon=second.address)).restore()
    assert step == 0 and np.array_equal(restored["x"], MIB)

    # Neither a stop nor the next daemon removes what a newer daemon wrote.
    kept = os.path.join(renamed, os.path.basename(records[("b", 0)]))
    with open(kept + ".meta") as f:
        written = f.read()
    assert second.stop() == 0
    assert sorted(os.listdir(renamed)) == sorted([os.path.basename(kept),
                                                  os.path.basename(kept) + ".meta",
                                                  "seg-9.meta", "future.idx"])
    third = _on(start_daemon, shm)
    assert [os.path.basename(f.path) for f in _status(third).adoption.kept] == \
        ["future.idx", os.path.basename(kept), "seg-9.meta"]
    assert third.stop() == 0
    [left] = os.listdir(shm)
    with open(os.path.join(shm, left, os.path.basename(kept) + ".meta")) as f:
        assert f.read() == written


def test_a_smaller_budget_keeps_the_newest_copies(start_daemon, shm_dirs):
    shm = shm_dirs()
    first = _on(start_daemon, shm, "--keep", "3")
    _snapshots(first, "job", range(3)).close()
    first.kill()
    second = _on(start_daemon, shm, "--memory-budget", "2.5MiB")
    status = _status(second)
    assert _adopted(status) == {("job", 0, 1), ("job", 0, 2)}
    assert [f.reason for f in status.adoption.dropped] == \
        ["step 0 of rank 0 of job 'job' does not fit the memory budget"]


def test_live_daemons_are_never_touched_and_two_starting_at_once_adopt_once(
        start_daemon, shm_dirs):
    shm = shm_dirs()
    first = _on(start_daemon, shm)
    _snapshots(first, "job", range(2)).close()
    first.kill()

    started = [None, None]
    threads = [threading.Thread(target=lambda i=i: started.__setitem__(
        i, _on(start_daemon, shm))) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    adoptions = [_adopted(_status(d)) for d in started]
    assert sorted(map(len, adoptions)) == [0, 2]  # one took both copies, the other nothing
    owner = started[0] if adoptions[0] else started[1]

    late = _on(start_daemon, shm)  # two live daemons' directories: nothing to take
    assert not _status(late).adoption.directories
    step, restored = NumpyClient("job", options=ClientOptions(daemon=owner.address)).restore()
    assert step == 1 and np.array_equal(restored["x"], MIB + 1)

    owner.kill()  # what it adopted is adopted again, by the next daemon
    again = _on(start_daemon, shm)
    assert _adopted(_status(again)) == {("job", 0, 0), ("job", 0, 1)}
    # Three live daemons' own directories and the one holding the copies: the killed
    # daemon's own, empty, is given up.
    assert len(os.listdir(shm)) == 4


def test_a_restarted_peer_adopts_its_replicas_and_the_group_counts_them(
        start_daemon, shm_dirs):
    shms = [shm_dirs(), shm_dirs()]
    ring = Ring(2, "--replicas", "1", "--log-level", "INFO",
                start=lambda *flags, **kw: start_daemon(
                    *flags, "--shm-dir", shms[int(flags[flags.index("--index") + 1])],
                    **{**kw, "own_shm_dir": False}))
    client = NumpyClient("job", options=ClientOptions(daemon=ring.addresses[0]))
    assert client.snapshot(0, {"x": MIB}, wait="job").committed
    peer = ring.daemons[1]
    flags = peer.proc.args[peer.proc.args.index("--peers"):]
    peer.kill()
    restarted = start_daemon(*flags, own_shm_dir=False)  # same ring position and ports
    adoption = _status(restarted).adoption
    assert [(c.job, c.rank, c.step, c.replica) for c in adoption.adopted] == \
        [("job", 0, 0, True)]

    def copies():
        job = ring.daemons[0].stub.Status(pb.StatusRequest(job="job"), timeout=10).jobs[0]
        return [r.copies for s in job.steps for r in s.ranks]
    wait_for(lambda: copies() == [2], "the group to count the adopted replica")
    assert client.snapshot(1, {"x": MIB + 1}, wait="job").committed
