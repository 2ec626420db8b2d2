"""A multi-host job's durable step is ONE Orbax checkpoint of its global state.

The ranks of ``tests/programs/regions_state.py`` copy different regions of
job-wide arrays (float32, bfloat16, a replicated int32 scalar) and arrays of
their own. A lone daemon holding both ranks, or two daemons in a ring (one
rank each), write each region once into one checkpoint, which plain Orbax
restores bit for bit in one fresh process and in two processes under
``jax.distributed``, into other shardings.
"""

import collections
import contextlib
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

from bubblesnap.clients import ClientOptions
from bubblesnap.clients.session import Session
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.service.durable import DurableReader, finalizer, storage
from bubblesnap.service.durable import checkpoint as durable_checkpoint
from bubblesnap.service.durable import format as fmt
from bubblesnap.service.errors import DataLoss
from bubblesnap.testing import wait_for
from bubblesnap.testing.multihost import JaxJob
from tests.helpers import ROOT
from tests.programs.regions_state import JOB, WORLD, global_state, rank_specs

RESTORE = str(ROOT / "tests" / "programs" / "orbax_restore.py") + ":check"
FLAGS = ("--durable-every-steps", "1")
FINALIZE = """if True:
    import sys
    from bubblesnap.service.durable import DurableReader
    from bubblesnap.service.durable.finalizer import Finalizer
    why = Finalizer(sys.argv[1], DurableReader(sys.argv[1])).finish("regions", 3, int(sys.argv[2]))
    assert why in (None, "another daemon is finalizing it"), why
"""


def session(daemon, rank: int, uneven: bool = False) -> Session:
    """A rank's session, registered (as a trainer registers before its first snapshot)."""
    opened = Session(JOB, rank, WORLD, ClientOptions(daemon=daemon.address))
    opened.register(rank_specs(rank, 0, uneven)[0])
    return opened


def snapshot(opened: Session, step: int, uneven: bool = False) -> None:
    specs, arrays = rank_specs(opened.rank, step, uneven)
    result = opened.snapshot(step, specs, lambda: arrays)
    assert result.taken, result.reason


def durable_steps(daemon) -> list[int]:
    return list(daemon.stub.Status(pb.StatusRequest(job=JOB), timeout=10).jobs[0].durable_steps)


def assert_one_checkpoint(step_dir, ranks) -> None:
    names = set(os.listdir(step_dir))
    assert {"_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt", "commit_success.txt"} <= names
    assert sorted(os.listdir(step_dir / ".bubblesnap")) == \
        ["complete.json", *(f"rank_{r}.json" for r in ranks)]
    assert sorted(n for n in names if n.startswith("ocdbt.process_")) == \
        [f"ocdbt.process_{r}" for r in ranks]
    assert not [n for n in names if n.startswith("rank_")]  # no checkpoint per rank


def assert_plain_orbax_restores(step_dir, step: int) -> None:
    args = {"checkpoint": str(step_dir), "step": step}
    alone = JaxJob(RESTORE, 1, args, devices=4).results()
    pair = JaxJob(RESTORE, 2, args, devices=2).results()
    assert alone[0]["processes"] == 1 and alone[0]["shards_checked"] > 0
    assert [p["processes"] for p in pair] == [2, 2]
    # each process holds half of the four devices' shards
    assert sum(p["shards_checked"] for p in pair) == alone[0]["shards_checked"]


def test_a_lone_daemon_writes_one_checkpoint_that_plain_orbax_restores(start_daemon, tmp_path,
                                                                        monkeypatch):
    durable = tmp_path / "durable"
    daemon = start_daemon("--durable-dir", str(durable), *FLAGS)
    sessions = [session(daemon, rank, uneven=True) for rank in range(WORLD)]
    for opened in sessions:
        snapshot(opened, 3, uneven=True)
        opened.close()
    wait_for(lambda: durable_steps(daemon) == [3], "step 3 finalized")
    step_dir = durable / JOB / "step_3"
    assert_one_checkpoint(step_dir, [0, 1])
    # params/b is cut [0:4] | [4:6], [6:12]: rank 0 alone would choose chunks of 4,
    # which rank 1's [4:6] would share; the daemon knows both layouts (both ranks
    # registered before the first snapshot) and chose 2.
    for rank in range(WORLD):
        sidecar = json.loads((step_dir / ".bubblesnap" / f"rank_{rank}.json").read_text())
        bias = next(t for t in sidecar["tensors"] if t["name"] == "params/b")
        assert bias["chunks"] == [2], bias
    assert_plain_orbax_restores(step_dir, 3)

    # The reader: what each rank wrote, and each region read back and verified.
    reader = DurableReader(str(durable))
    assert (reader.steps(JOB), reader.world_size(JOB), reader.world_size(JOB, 3)) == \
        ([3], WORLD, WORLD)
    expected = global_state(3)
    copies = reader.step_layouts(JOB, 3)
    assert sorted(copies) == [0, 1]
    for rank, copy in copies.items():
        assert copy.group == (rank,) and len(copy.checksums) == len(copy.layout.slots())
        for t_index, tensor in enumerate(copy.layout.tensors):
            leaf = tensor.name if tensor.job_wide else f"rank_{rank}/{tensor.name}"
            for s_index, shard in enumerate(tensor.shards):
                region = expected[leaf][tuple(slice(a, b) for a, b in shard.index)]
                [got] = reader.read_shards(JOB, 3, rank, [(t_index, s_index)])
                assert got.dtype == np.uint8 and got.tobytes() == region.tobytes()

    # One restore's view (Restorer.restore holds one): each step's folder, marker, rank
    # list and sidecars looked up once inside it (each a request on an object store).
    asked = collections.Counter()
    for name in ("step_path", "is_finalized", "written_ranks", "read_sidecar"):
        monkeypatch.setattr(fmt, name, functools.partial(
            lambda name, real, *args: asked.update([name]) or real(*args),
            name, getattr(fmt, name)))
    with reader.one_view():
        for _ in range(3):
            assert reader.step_layouts(JOB, 3) == copies
            assert reader.world_size(JOB, 3) == WORLD
    # (is_finalized twice: the folder's listing looks at the marker too)
    assert asked == {"step_path": 1, "is_finalized": 2, "written_ranks": 1, "read_sidecar": 2}
    assert reader.step_layouts(JOB, 3) == copies  # outside a view: asked again
    assert asked["read_sidecar"] == 4

    # Every region of a rank read in one call, a window of bytes at a time: the same
    # bytes in order, never more than the window in flight (one larger region alone).
    every = [(t, s) for t, tensor in enumerate(copies[0].layout.tensors)
             for s in range(len(tensor.shards))]
    one_by_one = [reader.read_shards(JOB, 3, 0, [key])[0].tobytes() for key in every]
    sizes = sorted(len(b) for b in one_by_one)
    for window in (1, sizes[-1] + sizes[-2], 1 << 30):
        monkeypatch.setattr(storage.PosixStorage, "read_bytes_in_flight", window)
        with _reads_in_flight(monkeypatch) as seen:
            got = reader.read_shards(JOB, 3, 0, every)
        assert [g.tobytes() for g in got] == one_by_one
        assert max(seen) == max(sizes) if window == 1 else max(seen) <= window
        assert (max(seen) == sum(sizes)) == (window == 1 << 30)

    # The current restore's path: rank 1's copy cut into its registered layout.
    _, checksums = reader.load(JOB, 1, 3, copies[1].layout)
    assert checksums == copies[1].checksums

    # Two daemons that see the step whole at once: one finalizes and publishes it, the
    # other leaves it (the finalizing lock); one folder, whole.
    partial = fmt.partial_path(str(durable), JOB, 3)
    os.rename(step_dir, partial)
    finalizer.reopen(partial)
    assert reader.steps(JOB) == []
    finalizers = [subprocess.Popen([sys.executable, "-c", FINALIZE, str(durable), str(r)],
                                   cwd=ROOT) for r in range(WORLD)]
    assert [p.wait(timeout=120) for p in finalizers] == [0, 0]
    assert reader.steps(JOB) == [3] and not os.path.exists(partial)
    assert sorted(os.listdir(durable / JOB)) == [".bubblesnap", "step_3"]
    JaxJob(RESTORE, 1, {"checkpoint": str(step_dir), "step": 3}, devices=4).results()

    # A daemon dies between finalizing the step and renaming it: the next daemon on the
    # tier publishes it as it starts.
    daemon.kill()
    os.rename(step_dir, partial)  # finalized (marked) but not renamed
    assert reader.steps(JOB) == []
    start_daemon("--durable-dir", str(durable), *FLAGS)
    wait_for(lambda: reader.steps(JOB) == [3], "the finalized step published")
    assert_plain_orbax_restores(step_dir, 3)

    # A region whose bytes changed on disk (still valid zarr) is refused.
    array = ts.open(durable_checkpoint.open_array(str(step_dir), "params.w",
                                                  durable_checkpoint.context()).result().spec(),
                    open=True).result()
    array[8:16, 0:4].write(np.zeros((8, 4), np.float32)).result()
    w_index = [t.name for t in copies[1].layout.tensors].index("params/w")
    with pytest.raises(DataLoss, match="does not match its checksum"):
        reader.read_shards(JOB, 3, 1, [(w_index, 0)])
    reader.read_shards(JOB, 3, 0, [(w_index, 0)])  # rank 0's regions are intact


@contextlib.contextmanager
def _reads_in_flight(monkeypatch):
    """The bytes of regions the reader had started and not yet taken, after each start."""
    seen, outstanding = [], [0]
    real = durable_checkpoint.read_box

    class Taken:
        def __init__(self, future, nbytes):
            self.future, self.nbytes = future, nbytes

        def result(self):
            outstanding[0] -= self.nbytes
            return self.future.result()

    def read_box(array, box, into):
        nbytes = int(np.prod([b - a for a, b in box])) * array.dtype.numpy_dtype.itemsize
        outstanding[0] += nbytes
        seen.append(outstanding[0])
        return Taken(real(array, box, into), nbytes)

    monkeypatch.setattr(durable_checkpoint, "read_box", read_box)
    yield seen
    monkeypatch.setattr(durable_checkpoint, "read_box", real)


def test_the_writer_never_allocates_a_global_array(start_daemon, tmp_path):
    """A job-wide array of 4 TiB of which rank 0 copies 256 KiB: a daemon that built
    the global array (np.zeros of its shape) could not write rank 0's part."""
    durable = tmp_path / "durable"
    daemon = start_daemon("--durable-dir", str(durable), *FLAGS)
    shape, box = (1 << 20, 1 << 20), ((0, 256), (0, 256))
    spec = pb.TensorSpec(name="huge", dtype="float32", global_shape=shape, job_wide=True,
                         shards=[pb.ShardSpec(index=[pb.Slice(start=a, stop=b) for a, b in box],
                                              nbytes=256 * 256 * 4, device="host")])
    region = np.arange(256 * 256, dtype=np.float32)
    session = Session(JOB, 0, WORLD, ClientOptions(daemon=daemon.address))
    assert session.snapshot(0, [spec], lambda: [region.view(np.uint8)]).taken
    session.close()
    sidecar = Path(fmt.partial_path(str(durable), JOB, 0)) / ".bubblesnap" / "rank_0.json"
    wait_for(sidecar.exists, "rank 0's part of step 0 written")
    written = json.loads(sidecar.read_text())["tensors"][0]
    assert (written["shape"], written["regions"], written["chunks"]) == \
        ([1 << 20, 1 << 20], [[[0, 256], [0, 256]]], [256, 256])
    assert durable_steps(daemon) == []  # rank 1 never wrote: not whole, not listed


def test_two_daemons_write_their_own_regions_into_one_checkpoint(start_ring, tmp_path):
    durable = tmp_path / "durable"
    ring = start_ring(2, "--replicas", "1", "--durable-dir", str(durable), *FLAGS)
    sessions = [session(ring.daemons[rank], rank) for rank in range(WORLD)]
    for opened in sessions:
        snapshot(opened, 0)
    reader = DurableReader(str(durable))
    wait_for(lambda: reader.steps(JOB) == [0], "step 0 finalized by one of the daemons")
    step_dir = durable / JOB / "step_0"
    assert_one_checkpoint(step_dir, [0, 1])
    assert_plain_orbax_restores(step_dir, 0)

    # Host 1 dies before its rank's part of step 1 is written: step 1 is never listed,
    # and plain Orbax finds no checkpoint there.
    ring.daemons[1].proc.kill()
    ring.daemons[1].kill()
    snapshot(sessions[0], 1)
    wait_for((Path(fmt.partial_path(str(durable), JOB, 1)) / ".bubblesnap" / "rank_0.json")
             .exists, "rank 0's part of step 1 written")
    assert reader.steps(JOB) == [0] and durable_steps(ring.daemons[0]) == [0]
    with pytest.raises(FileNotFoundError):
        ocp.StandardCheckpointer().restore(durable / JOB / "step_1")

    # Its replacement writes rank 1's part again: step 1 becomes one checkpoint.
    replacement = session(ring.replace(1), 1)
    snapshot(replacement, 1)
    wait_for(lambda: reader.steps(JOB) == [0, 1], "step 1 finalized")
    assert_one_checkpoint(durable / JOB / "step_1", [0, 1])
    assert_plain_orbax_restores(durable / JOB / "step_1", 1)
    sessions[0].close()
    replacement.close()
