"""A sick daemon costs a step nothing but a bound: a manager saving every step into a folder
its daemon writes, the daemon frozen (SIGSTOP) or killed after it took a step's write and
before it answered. The save waits its bound, then Orbax writes the step in the trainer;
the step is finalized once, every step the policy keeps restores bit for bit (plain
Orbax reads them too), the manager says so once in its log, and a daemon that wakes
drops its own write of the step and says so in Status. (Timings are the benchmark's:
benchmarks/sick_daemon.py --modes persisted.)"""

import logging
import os

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from bubblesnap.clients.jax import CheckpointManager, CheckpointManagerOptions, ClientOptions
from bubblesnap.clients.jax.tier.memory_tier import MemoryTier
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.shared import checkpoint_record
from bubblesnap.testing import wait_for

#: 64 MB: the daemon's write of a step takes tens of milliseconds, so a daemon stopped
#: right after it took the write has not answered yet (the test makes sure it has not).
ELEMENTS = 1 << 24


def state(step: int) -> dict:
    return {"w": jnp.arange(ELEMENTS, dtype=jnp.float32) + step, "step": step}


def plain(tree) -> tuple:
    return float(np.asarray(tree["w"]).sum()), tree["step"]


class StopsTheDaemon:
    """Stops (``how``) the daemon right after it took the write of a step, before it
    answered: the first save where that holds. ``stopped``: that step."""

    def __init__(self, daemon, how, monkeypatch):
        self.daemon, self.how, self.stopped = daemon, how, None
        save_item = MemoryTier.save_item

        def stopping(tier, item, handler, directory, args):
            futures = save_item(tier, item, handler, directory, args)
            if futures and self.stopped is None:
                folder = os.fspath(getattr(directory, "path", directory))
                self.daemon.freeze()
                if not os.path.exists(os.path.join(folder, checkpoint_record.persisted_file(0))):
                    self.stopped = tier.step
                    how()
                else:
                    self.daemon.thaw()  # it answered already: the next save, then
            return futures
        monkeypatch.setattr(MemoryTier, "save_item", stopping)


def every_step_saved(manager, steps) -> None:
    for step in steps:
        assert manager.save(step, args=ocp.args.StandardSave(state(step)))
    manager.wait_until_finished()


def assert_kept_steps_whole(directory, manager, last: int) -> None:
    assert manager.all_steps() == [last - 2, last - 1, last]
    assert sorted(os.listdir(directory)) == [str(s) for s in (last - 2, last - 1, last)]
    target = {"w": jnp.zeros((ELEMENTS,), jnp.float32), "step": 0}
    with ocp.CheckpointManager(directory) as reader:
        for step in manager.all_steps():
            assert plain(reader.restore(step, args=ocp.args.StandardRestore(target))) == \
                plain(state(step))


@pytest.mark.parametrize("sickness", ["frozen", "killed"])
def test_a_daemon_that_stops_answering_costs_a_save_its_bound(start_daemon, tmp_path,
                                                             monkeypatch, caplog, sickness):
    tier = tmp_path / "tier"
    directory = tier / "run"
    daemon = start_daemon("--durable-dir", str(tier), log_level="INFO")
    stop = StopsTheDaemon(daemon, (lambda: None) if sickness == "frozen" else daemon.kill,
                          monkeypatch)
    options = CheckpointManagerOptions(max_to_keep=3, client=ClientOptions(
        daemon=daemon.address))
    caplog.set_level(logging.WARNING, logger="bubblesnap.client")
    with CheckpointManager(directory, options=options) as manager:
        every_step_saved(manager, range(3))
        assert stop.stopped is not None and stop.stopped <= 2
        said = [r.message for r in caplog.records if "Orbax wrote item" in r.message]
        assert len(said) == 1 and f"of step {stop.stopped} " in said[0]
        if sickness == "frozen":
            daemon.thaw()  # it wakes, finds the step written, and drops its own write
            wait_for(lambda: any(f"step {stop.stopped} of rank 0" in note and
                                 "written by its trainer" in note for note in daemon.stub.Status(
                                     pb.StatusRequest(), timeout=10).durable_notes),
                     "the daemon's note that its write was dropped")
        every_step_saved(manager, range(3, 6))
        assert_kept_steps_whole(directory, manager, 5)
        assert len([r for r in caplog.records if "Orbax wrote item" in r.message]) == 1
