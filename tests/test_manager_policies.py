"""Orbax's options and policies mean the same with bubblesnap's manager: the same sequence of
saves, side by side with Orbax's manager in one process, answers the same ``should_save``,
``save``, ``all_steps``, ``latest_step`` and ``best_step`` after every step, and leaves the
same steps on disk, whatever the daemon keeps in memory (``--keep 1``); step folders get
Orbax's names; read-only managers save and delete nothing; Orbax's own options object is
accepted."""

import dataclasses
import datetime
import os

import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

from bubblesnap.clients.jax import CheckpointManager, CheckpointManagerOptions, ClientOptions

policies = ocp.checkpoint_managers
STEPS = 10


def loss(step: int) -> float:
    return [5.0, 3.0, 4.0, 1.0, 6.0, 2.0, 7.0, 0.5, 8.0, 9.0][step]


CASES = {
    "defaults": {},
    "interval": {"save_interval_steps": 3},
    "save_on_steps": {"save_interval_steps": 4, "save_on_steps": [1, 6]},
    "should_save_fn": {"should_save_fn": lambda step, last: step % 3 == 1},
    "fixed_policy": {"save_decision_policy": policies.FixedIntervalPolicy(2)},
    "specific_policy": {"save_decision_policy": policies.SpecificStepsPolicy([0, 3, 5])},
    "any_policy": {"save_decision_policy": policies.AnySavePolicy([
        policies.FixedIntervalPolicy(4), policies.SpecificStepsPolicy([5]),
        policies.InitialSavePolicy()])},
    "continuous": {"save_decision_policy": policies.ContinuousCheckpointingPolicy()},
    "preemption_only": {"save_decision_policy": policies.PreemptionCheckpointingPolicy()},
    "max_to_keep": {"max_to_keep": 2},
    "keep_period": {"max_to_keep": 2, "keep_period": 3},
    "keep_time_interval": {"max_to_keep": 1, "keep_time_interval": datetime.timedelta(hours=1)},
    "best": {"best_fn": lambda m: m["loss"], "best_mode": "min", "max_to_keep": 3},
    "best_max": {"best_fn": lambda m: m["loss"], "best_mode": "max", "max_to_keep": 2,
                 "keep_checkpoints_without_metrics": False},
    "preservation_policy": {"preservation_policy": policies.AnyPreservationPolicy([
        policies.LatestN(2), policies.CustomSteps([1])])},
}


def history(manager, with_metrics: bool) -> list:
    """What a loop sees of the manager, step by step, and the steps on disk at the end."""
    seen = []
    for step in range(STEPS):
        wanted = manager.should_save(step)
        metrics = {"loss": loss(step)} if with_metrics and step % 4 != 2 else None
        saved = manager.save(step, args=ocp.args.StandardSave({"x": jnp.full((3,), step)}),
                             metrics=metrics)
        seen.append((step, wanted, saved, list(manager.all_steps()), manager.latest_step()))
    manager.wait_until_finished()
    seen.append(("end", list(manager.all_steps()), manager.latest_step(), manager.best_step(),
                 sorted(os.listdir(manager.directory))))
    return seen


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """A daemon that keeps one step a job in memory: the policies decide what is on disk."""
    from bubblesnap.testing import DaemonProcess
    durable = tmp_path_factory.mktemp("durable")
    with DaemonProcess("--durable-dir", str(durable), "--keep", "1") as started:
        started.durable = durable
        yield started


def ours(daemon, name: str, **options) -> CheckpointManager:
    return CheckpointManager(daemon.durable / name, options=CheckpointManagerOptions(
        enable_async_checkpointing=False, client=ClientOptions(daemon=daemon.address),
        **options))


@pytest.mark.parametrize("case", sorted(CASES))
def test_options_and_policies_decide_as_orbax_decides(case, daemon, tmp_path):
    options = CASES[case]
    with_metrics = "best_fn" in options
    with ocp.CheckpointManager(tmp_path / case, options=ocp.CheckpointManagerOptions(
            enable_async_checkpointing=False, **options)) as theirs:
        expected = history(theirs, with_metrics)
    with ours(daemon, case, **options) as mine:
        assert history(mine, with_metrics) == expected


def test_orbax_options_object_and_folder_names(daemon, tmp_path, monkeypatch):
    """Orbax's own CheckpointManagerOptions (what a framework builds) is taken as is (the
    daemon from $BUBBLESNAP_DAEMON); the step folders are named as Orbax names them with a
    step_prefix and a fixed length, and plain Orbax lists and restores them."""
    options = ocp.CheckpointManagerOptions(step_prefix="ckpt", step_format_fixed_length=5,
                                           max_to_keep=20, enable_async_checkpointing=False)
    with ocp.CheckpointManager(tmp_path / "names", options=options) as theirs:
        for step in range(3):
            theirs.save(step, args=ocp.args.StandardSave({"x": jnp.zeros(2)}))
    monkeypatch.setenv("BUBBLESNAP_DAEMON", daemon.address)
    with CheckpointManager(daemon.durable / "names", options=options) as mine:
        for step in range(3):
            mine.save(step, args=ocp.args.StandardSave({"x": jnp.zeros(2)}))
    assert sorted(os.listdir(daemon.durable / "names")) == \
        sorted(os.listdir(tmp_path / "names")) == ["ckpt_00000", "ckpt_00001", "ckpt_00002"]
    with ocp.CheckpointManager(daemon.durable / "names", options=options) as reader:
        assert reader.all_steps() == [0, 1, 2]
        assert reader.restore(2, args=ocp.args.StandardRestore({"x": jnp.zeros(2)}))


def test_an_evaluator_restoring_an_older_step_leaves_the_trainer_s_steps(daemon):
    """A read-only manager (or one whose view is older) restoring a step drops nothing:
    Orbax never deletes on restore."""
    with ours(daemon, "evaluated") as trainer:
        trainer.save(1, args=ocp.args.StandardSave({"x": jnp.ones(2)}))
        evaluator = ours(daemon, "evaluated", read_only=True, save_interval_steps=0)
        trainer.save(2, args=ocp.args.StandardSave({"x": jnp.ones(2) * 2}))
        trainer.wait_until_finished()
        assert evaluator.latest_step() == 1  # its view is the one it loaded
        assert evaluator.restore(1)["x"].tolist() == [1.0, 1.0]
        stale = ours(daemon, "evaluated")
        trainer.save(3, args=ocp.args.StandardSave({"x": jnp.ones(2) * 3}))
        trainer.wait_until_finished()
        assert stale.restore(2)["x"].tolist() == [2.0, 2.0]  # not the newest a tier holds
        assert trainer.all_steps() == [1, 2, 3]
        evaluator.close()
        stale.close()


def test_read_only_saves_and_deletes_nothing(daemon):
    with ours(daemon, "ro") as writer:
        writer.save(0, args=ocp.args.StandardSave({"x": jnp.zeros(2)}))
    with ours(daemon, "ro", read_only=True, save_interval_steps=0) as reader:
        assert not reader.should_save(1)
        assert reader.save(1, args=ocp.args.StandardSave({"x": jnp.ones(2)})) is False
        reader.delete(0)
        assert reader.all_steps() == [0]
        assert reader.restore(0)["x"].tolist() == [0.0, 0.0]
    assert sorted(os.listdir(daemon.durable / "ro")) == ["0"]


def test_every_orbax_option_is_one_of_ours_with_its_default():
    """bubblesnap's options are Orbax's dataclass with fields added: a framework that
    builds either hands the manager the same meaning."""
    assert issubclass(CheckpointManagerOptions, ocp.CheckpointManagerOptions)
    theirs, mine = ocp.CheckpointManagerOptions(), CheckpointManagerOptions()
    for field in dataclasses.fields(ocp.CheckpointManagerOptions):
        assert getattr(mine, field.name) == getattr(theirs, field.name), field.name


@pytest.mark.parametrize("bad,match", [
    ({"record_bytes": 10}, "record_bytes"),
    ({"memory_interval_steps": -1}, "memory_interval_steps"),
    ({"client": "unix:///x"}, "client"),
])
def test_bad_options_fail_where_they_are_written(bad, match):
    with pytest.raises(ValueError, match=match):
        CheckpointManagerOptions(**bad)


def test_the_memory_interval_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("BUBBLESNAP_MEMORY_INTERVAL_STEPS", "4")
    assert CheckpointManagerOptions().memory_interval_steps == 4
    monkeypatch.setenv("BUBBLESNAP_MEMORY_INTERVAL_STEPS", "often")
    with pytest.raises(ValueError, match="BUBBLESNAP_MEMORY_INTERVAL_STEPS"):
        CheckpointManagerOptions()
