"""The durable tier writes standard Orbax checkpoints, loadable without the daemon."""

import json
import os
import time

import grpc
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bubblesnap.clients import RestoreError
from bubblesnap.clients.jax import ClientOptions, SnapshotClient
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.testing import wait_for
from tests.programs.trainer import state_at

ROWS = 32


def other_shardings():
    """Two devices instead of the four the state was saved from, other axes."""
    mesh = Mesh(np.array(jax.devices()[2:4]), ("x",))
    return {"w": NamedSharding(mesh, P(None, "x")), "m": NamedSharding(mesh, P("x")),
            "v": NamedSharding(mesh, P()), "count": NamedSharding(mesh, P())}


def other_target():
    shardings = other_shardings()
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k])
            for k, v in state_at(0, ROWS).items()}


def durable_steps(daemon, job):
    return list(daemon.stub.Status(pb.StatusRequest(job=job), timeout=10).jobs[0].durable_steps)


def assert_state(restored, step):
    expected = state_at(step, ROWS)
    for name, array in restored.items():
        assert np.asarray(array).tobytes() == np.asarray(expected[name]).tobytes(), name
        assert array.sharding.is_equivalent_to(other_shardings()[name], array.ndim), name


def compressors(step_dir) -> list:
    """The zarr compressor of every array of a step's checkpoint."""
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{step_dir}/"}).result()
    return [json.loads(kv.read(key).result().value)["compressor"]
            for key in kv.list().result() if key.endswith(b".zarray")]


@pytest.mark.parametrize("compression", ["", "zstd"])
def test_persisted_step_loads_with_plain_orbax_and_through_a_new_daemon(start_daemon, tmp_path,
                                                                        compression):
    durable = tmp_path / "durable"
    flags = ("--durable-dir", str(durable), "--durable-every-steps", "2", "--durable-keep", "1",
             *(("--durable-compression", compression) if compression else ()))
    daemon = start_daemon(*flags)
    client = SnapshotClient("dur", options=ClientOptions(daemon=daemon.address))
    for step in range(5):
        assert client.snapshot(step, state_at(step, ROWS), wait=True).taken
    client.close()
    deadline = time.monotonic() + 60
    # --durable-keep 1 removes 0 and 2 (the sidecar first, then the files, so the wait
    # covers both); steps are written in the job's .bubblesnap/partial, nothing is left there
    def folders():
        partial = durable / "dur" / ".bubblesnap" / "partial"
        return sorted(os.listdir(durable / "dur")), sorted(os.listdir(partial))
    while durable_steps(daemon, "dur") != [4] or folders() != ([".bubblesnap", "step_4"], []):
        assert time.monotonic() < deadline, durable_steps(daemon, "dur")
        time.sleep(0.2)

    # Stored as asked (default: not compressed), said in the zarr metadata Orbax reads.
    path = durable / "dur" / "step_4"
    written = compressors(path)
    assert len(written) == len(state_at(4, ROWS))
    assert all(c == ({"id": "zstd", "level": 1} if compression else None) for c in written)

    # No daemon involved: Orbax alone, into another sharding on other devices.
    assert_state(ocp.StandardCheckpointer().restore(path, other_target()), 4)

    # The host dies; a new daemon on it has an empty memory and restores from disk.
    daemon.kill()
    fresh = start_daemon(*flags)
    restored = SnapshotClient("dur", options=ClientOptions(daemon=fresh.address)).restore(
        other_target())
    assert (restored.step, restored.source) == (4, "durable")
    assert_state(restored.state, 4)


def test_damaged_durable_checkpoint_is_reported_not_served(start_daemon, tmp_path):
    durable = tmp_path / "durable"
    flags = ("--durable-dir", str(durable), "--durable-every-steps", "1")
    daemon = start_daemon(*flags)
    client = SnapshotClient("bad", options=ClientOptions(daemon=daemon.address))
    assert client.snapshot(0, state_at(0, ROWS), wait=True).taken
    client.close()
    deadline = time.monotonic() + 60
    while durable_steps(daemon, "bad") != [0]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    daemon.kill()
    for root, _, files in os.walk(durable / "bad" / "step_0"):
        if os.path.basename(root) != "d":
            continue
        for name in files:  # the OCDBT data files (small chunks live inline in the nodes)
            with open(os.path.join(root, name), "r+b") as f:
                data = bytearray(f.read())
                data[len(data) // 2] ^= 0xFF
                f.seek(0)
                f.write(data)
    fresh = start_daemon(*flags)
    with pytest.raises(grpc.RpcError) as info:
        fresh.stub.Restore(pb.RestoreRequest(job="bad", rank=0), timeout=60)
    assert info.value.code() == grpc.StatusCode.DATA_LOSS
    assert "durable" in info.value.details()
    # by regions, into the layout it was taken with: read straight into the segment
    # served, and verified there before anything is answered
    saved = state_at(0, ROWS)
    same = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
            for k, v in saved.items()}
    with pytest.raises(RestoreError, match=r"DATA_LOSS.*durable"):
        SnapshotClient("bad", options=ClientOptions(daemon=fresh.address)).restore(same)
    fresh.stop()
    assert "corrupt copy skipped" in fresh.stderr_text()  # recorded, not only refused


def test_a_shard_of_many_chunks_is_written_and_read_in_pieces_plain_orbax_reads(
        start_daemon, tmp_path, monkeypatch):
    from bubblesnap.service.durable import checkpoint, reader
    from bubblesnap.service.durable.checkpoint import CHUNK_BYTES
    from bubblesnap.service.durable.reader import DurableReader

    # one shard of 5+ chunks, more than a piece the writer hands over or the reader reads
    rows, cols = 5 * CHUNK_BYTES // (4 * 1024) + 8, 1024
    assert rows * cols * 4 > max(checkpoint._WRITE_PIECE_BYTES, reader.READ_PIECE_BYTES)
    values = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    state = {"big": jax.device_put(values, jax.devices()[0]),
             "small": jax.device_put(np.arange(8, dtype=np.int32), jax.devices()[1])}
    durable = tmp_path / "durable"
    flags = ("--durable-dir", str(durable), "--durable-every-steps", "1")
    daemon = start_daemon(*flags)
    client = SnapshotClient("chunks", options=ClientOptions(daemon=daemon.address))
    assert client.snapshot(0, state, wait=True).taken
    client.close()
    wait_for(lambda: durable_steps(daemon, "chunks") == [0], "step 0 written durably")

    [written] = DurableReader(str(durable)).sidecars("chunks", 0).values()
    chunks = {t.name: t.chunks for t in written.tensors}
    assert chunks["small"] == (8,)
    assert chunks["big"][1:] == (cols,) and chunks["big"][0] < rows  # cut along the rows
    assert np.prod(chunks["big"]) * 4 <= CHUNK_BYTES

    # Read a chunk row at a time, the region verified once whole.
    monkeypatch.setattr(reader, "READ_PIECE_BYTES", 1)
    boxes, real = [], checkpoint.read_box
    monkeypatch.setattr(checkpoint, "read_box", lambda a, box, into: (boxes.append(box),
                                                                     real(a, box, into))[1])
    big = next(i for i, t in enumerate(written.tensors) if t.name == "big")
    [got] = DurableReader(str(durable)).read_shards("chunks", 0, 0, [(big, 0)])
    assert got.tobytes() == values.tobytes()
    assert [box[0] for box in boxes] == [(a, min(a + chunks["big"][0], rows))
                                         for a in range(0, rows, chunks["big"][0])]

    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
              for k, v in state.items()}
    plain = ocp.StandardCheckpointer().restore(durable / "chunks" / "step_0", target)
    daemon.kill()
    restored = SnapshotClient("chunks", options=ClientOptions(
        daemon=start_daemon(*flags).address)).restore(target)
    assert restored.source == "durable"
    for got in (plain, restored.state):
        assert {k: np.asarray(v).tobytes() for k, v in got.items()} == \
            {k: np.asarray(v).tobytes() for k, v in state.items()}


def test_a_write_is_committed_in_batches_no_larger_than_its_bound(tmp_path, monkeypatch):
    """TensorStore holds a copy of what a batch was given until it commits: a write of
    many chunks, a stack of layers among them, commits batch after batch, none past the
    bound, and the database then holds every byte."""
    import tensorstore as ts

    from bubblesnap.service.durable import checkpoint

    chunk = 1 << 20
    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(checkpoint, "_WRITE_PIECE_BYTES", chunk)
    committed, commit = [], checkpoint._Batch.commit

    def counted(batch):
        committed.append(batch._bytes)
        commit(batch)
    monkeypatch.setattr(checkpoint._Batch, "commit", counted)
    arrays = {  # ten chunks of (256, 1024) float32; three 2 MiB layers; 4 KiB
        "big": np.arange(10 * 256 * 1024, dtype=np.float32).reshape(2560, 1024),
        "stack": np.arange(3 * 512 * 1024, dtype=np.float32).reshape(3, 512, 1024),
        "small": np.arange(1024, dtype=np.int32).reshape(4, 256)}
    parts = [checkpoint.ArrayPart(name, str(data.dtype), data.shape, data.shape,
                                  ((tuple((0, n) for n in data.shape), data),))
             for name, data in arrays.items()]
    chunks = checkpoint.write_parts(str(tmp_path), 0, parts, batch_bytes=3 * chunk)

    assert chunks["big"] == (256, 1024)
    assert chunks["stack"] == (1, 256, 1024)  # a layer is two chunks
    # every piece one chunk: batches of three, what is left in the last
    assert committed == [3 * chunk] * 5 + [chunk + arrays["small"].nbytes]
    for name, data in arrays.items():
        stored = ts.open({"driver": "zarr", "kvstore": {
            "driver": "ocdbt", "base": f"file://{tmp_path}/ocdbt.process_0/",
            "path": name}}).result().read().result()
        assert stored.dtype == data.dtype and stored.tobytes() == data.tobytes(), name
