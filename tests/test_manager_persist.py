"""The steps a CheckpointManager's policy keeps reach disk through the daemon, exactly as
Orbax would write them, whatever the daemon keeps in memory: ``wait_until_finished`` and
``close`` return with every saved step finalized in the directory (nothing of
bubblesnap's in it); a backlog skips nothing; restores come from memory (the data files
on disk are not read); a step saved anew never meets the daemons' copy of an earlier
save of it; a daemon that refuses a step's write when the save asks for it leaves the
step to Orbax, as plain Orbax writes it."""

import os
import shutil

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from bubblesnap.clients.jax import CheckpointManager, CheckpointManagerOptions, ClientOptions
from bubblesnap.testing import DaemonProcess


def options(address: str, **more) -> CheckpointManagerOptions:
    return CheckpointManagerOptions(client=ClientOptions(daemon=address), **more)


def state(step: int, size: int = 16) -> dict:
    return {"w": jnp.arange(size, dtype=jnp.float32) * (step + 1), "step": step}


def plain(tree) -> dict:
    return {"w": np.asarray(tree["w"]).tolist(), "step": tree["step"]}


def written(daemon) -> list[str]:
    return [line for line in daemon.stderr_text().splitlines() if "durable: wrote step" in line]


@pytest.fixture
def daemon(start_daemon, tmp_path):
    """A daemon keeping one step a job in memory, whose durable tier holds tmp_path."""
    return start_daemon("--durable-dir", str(tmp_path), "--keep", "1", log_level="INFO",
                        stderr=tmp_path / "daemon.log")


@pytest.mark.parametrize("finish", ["wait_until_finished", "close"])
def test_every_step_the_policy_keeps_is_on_disk_when_the_wait_returns(daemon, tmp_path,
                                                                       finish):
    directory = tmp_path / "run"
    manager = CheckpointManager(directory, options=options(daemon.address))
    for step in range(5):
        assert manager.save(step, args=ocp.args.StandardSave(state(step, 1 << 16)))
    getattr(manager, finish)()
    # what is in the folder the moment the call returns: the five steps, whole, nothing else
    assert sorted(os.listdir(directory)) == ["0", "1", "2", "3", "4"]
    assert len(written(daemon)) == 5  # each written by the daemon, none skipped (--keep 1)
    with ocp.CheckpointManager(directory) as reader:
        assert reader.all_steps() == [0, 1, 2, 3, 4]
        for step in range(5):
            assert plain(reader.restore(step)) == plain(state(step, 1 << 16))
    if finish == "wait_until_finished":
        assert manager.all_steps() == [0, 1, 2, 3, 4]
        manager.close()


def test_restores_come_from_the_daemons_memory(daemon, tmp_path):
    directory = tmp_path / "run"
    with CheckpointManager(directory, options=options(daemon.address)) as manager:
        manager.save(7, args=ocp.args.StandardSave(state(7)))
        manager.wait_until_finished()
    item = directory / "7" / "default"
    for name in os.listdir(item):  # the arrays' data on disk is gone
        if name == "d" or name.startswith("ocdbt.process_"):
            shutil.rmtree(item / name)
    target = jax_target(state(0))
    with CheckpointManager(directory, options=options(daemon.address)) as manager:
        assert plain(manager.restore(7, args=ocp.args.StandardRestore(target))) == \
            plain(state(7))
    with pytest.raises(Exception):  # noqa: B017 - whatever Orbax raises for missing data
        ocp.CheckpointManager(directory).restore(7, args=ocp.args.StandardRestore(target))


def jax_target(tree):
    return {"w": jnp.zeros_like(tree["w"]), "step": 0}


def test_a_step_saved_anew_never_meets_an_earlier_save_of_it(daemon, tmp_path):
    directory = tmp_path / "run"
    with CheckpointManager(directory, options=options(daemon.address)) as manager:
        for step in (3, 4):
            manager.save(step, args=ocp.args.StandardSave(state(step)))
        manager.wait_until_finished()
        assert plain(manager.restore(4)) == plain(state(4))
        # deleted, then saved again with other values: the new values come back
        manager.delete(4)
        again = {**state(4), "w": jnp.full((16,), -1.0)}
        manager.save(4, args=ocp.args.StandardSave(again), force=True)
        manager.wait_until_finished()
        assert plain(manager.restore(4)) == plain(again)
        assert plain(manager.restore(4, args=ocp.args.StandardRestore(jax_target(again)))) == \
            plain(again)


def test_a_run_resumed_after_a_crash_drops_the_copies_it_overwrites(daemon, tmp_path):
    """A run saved step 2 into memory and died before Orbax finished it; the next run
    resumes from step 1 and saves step 2 anew: its restore of step 2 is its own."""
    directory = tmp_path / "run"
    first = CheckpointManager(directory, options=options(daemon.address))
    first.save(1, args=ocp.args.StandardSave(state(1)))
    first.wait_until_finished()
    # the copy of step 2 into memory, as its save began it; then the process died before
    # the step reached disk (what a SIGKILL leaves, without its timing)
    tier = first._tier
    assert tier.snapshot_in_memory("default", ocp.StandardCheckpointHandler(), 2,
                                   ocp.args.StandardSave(state(2)))
    tier.client(tier.job("default")).wait()
    with CheckpointManager(directory, options=options(daemon.address)) as second:
        assert second.latest_step() == 1
        resumed = {**state(2), "w": jnp.full((16,), 5.0)}
        second.save(2, args=ocp.args.StandardSave(resumed))
        second.wait_until_finished()
        assert plain(second.restore(2)) == plain(resumed)
    first.close()


def test_a_write_the_daemon_refuses_is_orbax_s_own(tmp_path, shm_dirs):
    """The daemon the manager met wrote into its durable tier; the one that answers now
    (restarted on the same socket) has another: it refuses the write when the save asks
    for it (before save returns), and Orbax writes the step itself, as plain Orbax."""
    socket = f"unix://{tmp_path}/daemon.sock"
    directory = tmp_path / "tier" / "run"
    with DaemonProcess("--durable-dir", str(tmp_path / "tier"), "--listen", socket):
        manager = CheckpointManager(directory, options=options(socket))
        manager.save(0, args=ocp.args.StandardSave(state(0)))
        manager.wait_until_finished()
    with DaemonProcess("--durable-dir", str(tmp_path / "other"), "--listen", socket) as other:
        # the new daemon does not know the job yet: Orbax writes step 1 itself
        manager.save(1, args=ocp.args.StandardSave(state(1)))
        # registered anew, the daemon takes the copy of step 2 and refuses to write it
        manager.save(2, args=ocp.args.StandardSave(state(2)))
        manager.wait_until_finished()
        assert manager.all_steps() == [0, 1, 2]
        assert not written(other)
        with ocp.CheckpointManager(directory) as reader:
            assert plain(reader.restore(2)) == plain(state(2))
        manager.close()
