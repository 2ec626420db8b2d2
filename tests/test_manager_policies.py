"""Orbax's options and policies mean the same with bubblesnap's manager: the same sequence of
saves, side by side with Orbax's manager in one process, answers the same ``should_save``,
``save``, ``all_steps``, ``latest_step`` and ``best_step`` after every step; step folders get
Orbax's names; read-only managers save and delete nothing; options without meaning here are
named in one warning, never a TypeError; and Orbax's own options object is accepted."""

import dataclasses
import datetime
import logging
import os

import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

from bubblesnap.clients.jax import CheckpointManager, CheckpointManagerOptions, ClientOptions
from bubblesnap.testing import wait_for

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
    """What a loop sees of the manager, step by step."""
    seen = []
    for step in range(STEPS):
        wanted = manager.should_save(step)
        metrics = {"loss": loss(step)} if with_metrics and step % 4 != 2 else None
        saved = manager.save(step, args=ocp.args.StandardSave({"x": jnp.full((3,), step)}),
                             metrics=metrics)
        seen.append((step, wanted, saved, list(manager.all_steps()), manager.latest_step()))
    manager.wait_until_finished()
    seen.append(("end", list(manager.all_steps()), manager.latest_step(), manager.best_step()))
    return seen


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    from bubblesnap.testing import DaemonProcess
    durable = tmp_path_factory.mktemp("durable")
    with DaemonProcess("--durable-dir", str(durable), "--durable-every-steps", "1",
                       "--keep", str(STEPS)) as started:
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


def test_orbax_options_object_and_folder_names(daemon, tmp_path):
    """Orbax's own CheckpointManagerOptions (what a framework builds) is taken as is; the
    daemon names step folders as Orbax does with step_prefix and a fixed length."""
    options = ocp.CheckpointManagerOptions(step_prefix="ckpt", step_format_fixed_length=5,
                                           max_to_keep=20, enable_async_checkpointing=False)
    with ocp.CheckpointManager(tmp_path / "names", options=options) as theirs:
        for step in range(3):
            theirs.save(step, args=ocp.args.StandardSave({"x": jnp.zeros(2)}))
    with CheckpointManager(daemon.durable / "names", options=options) as mine:
        assert mine._options.client.daemon  # the default client options: $BUBBLESNAP_DAEMON
    os.environ["BUBBLESNAP_DAEMON"] = daemon.address
    try:
        with CheckpointManager(daemon.durable / "names", options=options) as mine:
            for step in range(3):
                mine.save(step, args=ocp.args.StandardSave({"x": jnp.zeros(2)}))
    finally:
        del os.environ["BUBBLESNAP_DAEMON"]
    orbax_names = set(os.listdir(tmp_path / "names"))

    def written():
        return {n for n in os.listdir(daemon.durable / "names") if not n.startswith(".")}
    wait_for(lambda: written(), "a step persisted")
    assert written() <= orbax_names and all(n.startswith("ckpt_000") for n in written())
    # plain Orbax with the same naming lists and restores the daemon's steps
    with ocp.CheckpointManager(daemon.durable / "names", options=options) as reader:
        step = reader.latest_step()
        assert step is not None
        assert reader.restore(step, args=ocp.args.StandardRestore({"x": jnp.zeros(2)}))


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


def test_read_only_saves_and_deletes_nothing(daemon, caplog):
    with ours(daemon, "ro") as writer:
        writer.save(0, args=ocp.args.StandardSave({"x": jnp.zeros(2)}))
    with caplog.at_level(logging.WARNING, logger="bubblesnap.client"):
        with ours(daemon, "ro", read_only=True, save_interval_steps=0) as reader:
            assert not reader.should_save(1)
            assert reader.save(1, args=ocp.args.StandardSave({"x": jnp.ones(2)})) is False
            reader.delete(0)
            assert reader.all_steps() == [0]
            assert reader.restore(0)["x"].tolist() == [0.0, 0.0]
    assert "read only" in caplog.text


def test_options_without_meaning_are_named_in_one_warning(daemon, caplog):
    with caplog.at_level(logging.WARNING, logger="bubblesnap.client"):
        ours(daemon, "noop", todelete_subdir="trash", enable_background_delete=True,
             cleanup_tmp_directories=True).close()
    warnings = [r.getMessage() for r in caplog.records if "have no effect" in r.getMessage()]
    assert len(warnings) == 1
    for name in ("todelete_subdir", "enable_background_delete", "cleanup_tmp_directories"):
        assert name in warnings[0]


def test_every_orbax_option_is_one_of_ours():
    """A new Orbax release that adds an option fails here, not in a user's constructor."""
    theirs = {f.name for f in dataclasses.fields(ocp.CheckpointManagerOptions)}
    mine = {f.name for f in dataclasses.fields(CheckpointManagerOptions)}
    assert theirs <= mine
    for field in dataclasses.fields(ocp.CheckpointManagerOptions):
        if field.default is not dataclasses.MISSING:
            assert getattr(CheckpointManagerOptions(), field.name) == field.default, field.name


@pytest.mark.parametrize("bad,match", [
    ({"save_interval_steps": 0}, "save_interval_steps"),
    ({"max_to_keep": -1}, "max_to_keep"),
    ({"best_mode": "median"}, "best_mode"),
    ({"step_prefix": "../up"}, "step prefix"),
    ({"step_format_fixed_length": 0}, "step_format_fixed_length"),
    ({"preservation_policy": policies.LatestN(1), "max_to_keep": 2}, "preservation_policy"),
    ({"record_bytes": 10}, "record_bytes"),
])
def test_bad_options_fail_where_they_are_written(bad, match):
    with pytest.raises(ValueError, match=match):
        CheckpointManagerOptions(**bad)
