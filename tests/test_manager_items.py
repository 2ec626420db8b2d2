"""Items of handlers other than Orbax's stock PyTree and Standard handlers (a data loader's
own handler, the shape of Grain's; Orbax's ArraySave; JSON items, small and large) are
saved by those handlers into the same step, as Orbax saves them, and restored through
them; the pytree items beside them go through the daemon. Plain Orbax restores the whole
step. An item record that is not one makes the daemon's write fail, saying why in the
folder, nothing else written, the copy in memory kept. The legacy ``items=`` API and a job
saved with another record size work as in Orbax."""

import os

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from bubblesnap.clients import ClientOptions, Session
from bubblesnap.clients.jax import CheckpointManager, CheckpointManagerOptions
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.shared import checkpoint_record
from bubblesnap.testing import wait_for
from tests.programs.iterator_loop import PositionHandler, PositionRestore, PositionSave


def save(manager, step: int, meta_size: int = 1) -> bool:
    state = {"w": jnp.arange(6.0) * step, "step": step}
    return manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        loader=PositionSave(step + 1),
        bias=ocp.args.ArraySave(np.full((4,), step, np.float32)),
        meta=ocp.args.JsonSave({"notes": "x" * meta_size, "step": step})))


def restore(manager, step: int):
    return manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore({"w": jnp.zeros(6), "step": 0}),
        loader=PositionRestore(), bias=ocp.args.ArrayRestore(),
        meta=ocp.args.JsonRestore()))


def as_plain(restored) -> dict:
    return {"w": np.asarray(restored.state["w"]).tolist(), "step": restored.state["step"],
            "loader": restored.loader, "bias": np.asarray(restored.bias).tolist(),
            "meta": restored.meta}


@pytest.mark.parametrize("meta_size", [1, 20_000])
def test_items_of_other_handlers_are_theirs_in_the_same_step(start_daemon, tmp_path,
                                                           meta_size):
    names = ("state", "loader", "bias", "meta")
    with ocp.CheckpointManager(tmp_path / "orbax", item_names=names) as theirs:
        for step in range(3):
            save(theirs, step, meta_size)
        theirs.wait_until_finished()
        expected = as_plain(restore(theirs, 2))

    durable = tmp_path / "durable"
    daemon = start_daemon("--durable-dir", str(durable), log_level="INFO",
                          stderr=tmp_path / "daemon.log")
    options = CheckpointManagerOptions(client=ClientOptions(daemon=daemon.address),
                                       record_bytes=8192)
    with CheckpointManager(durable / "job", item_names=names, options=options) as mine:
        assert all(save(mine, step, meta_size) for step in range(3))
        mine.wait_until_finished()
        assert as_plain(restore(mine, 2)) == expected  # the state from memory
        assert mine.all_steps() == [0, 1, 2]
    written = [line for line in daemon.stderr_text().splitlines() if "durable: wrote" in line]
    assert len(written) == 3 and all("/job/state " in line for line in written)
    assert sorted(os.listdir(durable / "job" / "2")) == sorted(os.listdir(tmp_path / "orbax" /
                                                                           "2"))
    with ocp.CheckpointManager(durable / "job", item_names=names,
                               item_handlers={"loader": PositionHandler()}) as plain:
        assert as_plain(restore(plain, 2)) == expected
    with CheckpointManager(durable / "job", item_names=names, options=options) as again:
        assert as_plain(restore(again, 2)) == expected  # a new run reads them back


def test_an_item_record_that_is_not_one_fails_the_write_and_says_so(start_daemon, tmp_path):
    durable = tmp_path / "durable"
    daemon = start_daemon("--durable-dir", str(durable), stderr=tmp_path / "daemon.log")
    text = b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all"
    junk = np.frombuffer(text + bytes(4096 - len(text)), np.uint8)
    specs = [pb.TensorSpec(name=checkpoint_record.TENSOR, dtype="uint8", global_shape=[4096],
                           job_wide=True, shards=[pb.ShardSpec(
                               index=[pb.Slice(start=0, stop=4096)], nbytes=4096)]),
             pb.TensorSpec(name="default/w", dtype="float32", global_shape=[2],
                           job_wide=True, shards=[pb.ShardSpec(
                               index=[pb.Slice(start=0, stop=2)], nbytes=8)])]
    job = str(durable / "hostile" / "default")
    session = Session(job, 0, 1, ClientOptions(daemon=daemon.address))
    weights = np.ones(2, np.float32).view(np.uint8)
    assert session.snapshot(0, specs, lambda: [junk, weights], wait="job").committed
    folder = durable / "hostile" / "0" / "default"
    folder.mkdir(parents=True)
    session.call("Persist", pb.PersistRequest(job=job, rank=0, step=0, directory=str(folder)))
    failed = folder / checkpoint_record.failed_file(0)
    wait_for(failed.exists, "the write's failure said in the folder")
    assert "item record is malformed" in failed.read_text()
    assert sorted(os.listdir(folder)) == [checkpoint_record.STATE_DIR]  # nothing else
    assert daemon.healthy()
    # the copy in memory is untouched and restorable as the bytes it was given
    found = session.restore(0)
    assert bytes(found.shards[(1, 0)]) == weights.tobytes()
    session.close()


def legacy_history(Manager, root):
    """Orbax's legacy API: checkpointers at construction, items= and save_kwargs."""
    out = []
    single = Manager(root / "single", ocp.Checkpointer(ocp.PyTreeCheckpointHandler()),
                     options=ocp.CheckpointManagerOptions(max_to_keep=2))
    for step in range(3):
        single.save(step, {"a": jnp.ones(2) * step, "n": step})
    single.wait_until_finished()
    restored = single.restore(2, items={"a": jnp.zeros(2), "n": 0})
    out.append((single.all_steps(), restored["a"].tolist(), restored["n"]))
    single.close()
    named = Manager(root / "named", {"state": ocp.Checkpointer(ocp.PyTreeCheckpointHandler()),
                                     "meta": ocp.Checkpointer(ocp.JsonCheckpointHandler())})
    named.save(0, {"state": {"a": jnp.ones(2)}, "meta": {"x": 1}})
    named.wait_until_finished()
    restored = named.restore(0, items={"state": {"a": jnp.zeros(2)}, "meta": None})
    out.append((restored["state"]["a"].tolist(), restored["meta"]))
    named.close()
    return out


def test_orbax_legacy_items_form_works_as_in_orbax(start_daemon, tmp_path, monkeypatch):
    expected = legacy_history(ocp.CheckpointManager, tmp_path / "orbax")
    daemon = start_daemon("--keep", "3")
    monkeypatch.setenv("BUBBLESNAP_DAEMON", daemon.address)
    assert legacy_history(CheckpointManager, tmp_path / "ours") == expected


def test_a_job_saved_with_another_record_size_is_still_read(start_daemon, tmp_path):
    daemon = start_daemon("--keep", "3")
    client = ClientOptions(daemon=daemon.address)
    small = CheckpointManagerOptions(client=client, record_bytes=8192)
    with CheckpointManager(tmp_path / "resized", options=small) as first:
        first.save(0, args=ocp.args.StandardSave({"x": jnp.ones(3), "n": 4}))
    with CheckpointManager(tmp_path / "resized",
                           options=CheckpointManagerOptions(client=client)) as second:
        assert second.all_steps() == [0]
        assert second.restore(0)["n"] == 4
