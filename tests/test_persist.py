"""The Persist call writes only where a trainer may have it write: a folder inside the
daemon's ``--durable-dir`` (symbolic links resolved) of a step Orbax is saving (made by
Orbax, maybe after the call: the write waits for it), for a CheckpointManager's item the
daemon holds. Every other target is refused with a precise
status and a message that says what to do; nothing is written, and the daemon keeps what
it held (a good Persist of the same copy still writes it)."""

import os

import grpc
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

from bubblesnap.clients.jax import CheckpointManager, CheckpointManagerOptions, ClientOptions
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.shared import checkpoint_record
from bubblesnap.testing import wait_for

ITEM = "default"


def held_item(daemon, directory) -> str:
    """Saves step 0 of a manager of ``directory`` (outside the daemon's durable tier:
    Orbax writes it, the daemon holds it in memory); its item's job."""
    options = CheckpointManagerOptions(client=ClientOptions(daemon=daemon.address))
    with CheckpointManager(directory, options=options) as manager:
        manager.save(0, args=ocp.args.StandardSave({"w": jnp.arange(8.0)}))
        manager.wait_until_finished()
    return f"{os.path.realpath(directory)}/{ITEM}"


def persist(daemon, job: str, folder: str, step: int = 0):
    return daemon.stub.Persist(pb.PersistRequest(job=job, rank=0, step=step,
                                                 directory=str(folder)), timeout=10)


def refusal(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as raised:
        call(*args, **kwargs)
    return raised.value.code(), raised.value.details()


def item_folder(root, step: int = 0):
    """An item folder of a step being saved (its step folder made, as Orbax makes it)."""
    step_folder = root / f"{step}.orbax-checkpoint-tmp"
    step_folder.mkdir(parents=True, exist_ok=True)
    return step_folder / ITEM


def test_persist_writes_only_inside_the_durable_tier(start_daemon, tmp_path):
    tier, outside = tmp_path / "tier", tmp_path / "outside"
    tier.mkdir()
    daemon = start_daemon("--durable-dir", str(tier))
    job = held_item(daemon, outside / "run")
    (tier / "link").symlink_to(outside, target_is_directory=True)
    cases = {
        "relative": ("run/0/default", grpc.StatusCode.INVALID_ARGUMENT, "absolute"),
        "not normalized": (f"{tier}/x/../0/default", grpc.StatusCode.INVALID_ARGUMENT,
                           "normalized"),
        "outside": (item_folder(outside / "elsewhere"), grpc.StatusCode.FAILED_PRECONDITION,
                    "--durable-dir at or above"),
        "through a link": (item_folder(tier / "link" / "escape"),
                           grpc.StatusCode.FAILED_PRECONDITION, "outside this daemon's"),
    }
    for name, (folder, code, says) in cases.items():
        got, details = refusal(persist, daemon, job, folder)
        assert (got, says in details) == (code, True), (name, details)
        assert len(details) <= 1024, name
    target = item_folder(tier / "run")
    got, details = refusal(persist, daemon, "native", target)
    assert got == grpc.StatusCode.FAILED_PRECONDITION and "--durable-every-steps" in details
    got, details = refusal(persist, daemon, job, target, step=5)
    assert got == grpc.StatusCode.NOT_FOUND, details
    # nothing written where it was refused
    assert not any(name.startswith("ocdbt") or name == ".bubblesnap"
                   for _, dirs, files in os.walk(outside / "elsewhere") for name in dirs + files)
    assert not target.exists()
    # the daemon kept the copy: the same Persist into a folder of its tier writes it, once
    # the folder is made (Orbax makes a step's folders in the background, after the call)
    persist(daemon, job, target)
    assert not target.exists()
    target.mkdir()
    sidecar = target / checkpoint_record.STATE_DIR / "rank_0.json"
    wait_for(sidecar.exists, "the persisted copy's sidecar")
    assert (target / "ocdbt.process_0").is_dir()


def test_a_daemon_without_a_durable_tier_says_how_to_get_one(start_daemon, tmp_path):
    daemon = start_daemon()
    job = held_item(daemon, tmp_path / "run")
    got, details = refusal(persist, daemon, job, item_folder(tmp_path / "run"))
    assert got == grpc.StatusCode.FAILED_PRECONDITION
    assert "start it with --durable-dir" in details



def test_a_staging_folder_is_made_while_another_rank_s_move_in_removes_its_parents(
        tmp_path, monkeypatch):
    """Two daemons write two ranks' parts of one item: one's move_in removes the shared
    staging parents once they are empty, here at the worst moment, between the other's
    creation of those parents and of its own folder (the soak's seed 112 lost a part so:
    TensorStore's mkdir met a parent removed under it). The folder is made all the same."""
    from bubblesnap.service.durable import persist

    folder = str(tmp_path / "run" / "6.orbax-checkpoint-tmp" / "state.orbax-checkpoint-tmp")
    staging = persist.staging_path(folder, 0)
    mkdir, struck = os.mkdir, []

    def mkdir_after_a_move_in(path, *args, **kwargs):
        if os.fspath(path) == staging and not struck:
            struck.append(path)
            os.rmdir(os.path.dirname(staging))  # the other rank's move_in, done
            os.rmdir(os.path.dirname(os.path.dirname(staging)))
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir_after_a_move_in)
    assert persist.make_staging(folder, 0) == staging
    assert struck and os.path.isdir(staging)


def test_a_rank_that_wrote_no_database_moves_nothing_and_is_done(tmp_path):
    """Orbax writes replica 0 only: a process whose every shard is a replica another writes
    (the second slice of Orbax's emergency tests) leaves no ``ocdbt.process_N`` folder,
    and its daemon's write of it is done all the same (it once failed NOT_FOUND, and the
    4-process job waited in Orbax's barriers). A rank that did write is moved in."""
    from bubblesnap.service.durable import persist

    folder = tmp_path / "run" / "0.orbax-checkpoint-tmp" / "state.orbax-checkpoint-tmp"
    folder.mkdir(parents=True)
    empty = persist.make_staging(str(folder), 2)
    assert persist.move_in(empty, str(folder), 2)
    assert not os.path.exists(empty) and not (folder / "ocdbt.process_2").exists()
    written = persist.make_staging(str(folder), 0)
    os.makedirs(os.path.join(written, "ocdbt.process_0"))
    assert persist.move_in(written, str(folder), 0)
    assert (folder / "ocdbt.process_0").is_dir() and not os.path.exists(written)
