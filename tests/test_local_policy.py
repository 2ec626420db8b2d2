"""The local tier's policies (clients/jax/tier/local_policy.py), pure: Orbax's emergency
LocalCheckpointOptions turned into which steps are saved and kept, as Orbax's local
manager decides them (the expectations are those of Orbax's own emergency tests)."""

import pytest
from orbax.checkpoint._src.checkpoint_managers import preservation_policy, save_decision_policy
from orbax.checkpoint.experimental.emergency.checkpoint_manager import LocalCheckpointOptions

from bubblesnap.clients.jax.tier.local_policy import LocalPolicy


def run(policy: LocalPolicy, steps: int) -> tuple[list[int], list[int]]:
    """(saved, kept) after steps 0..steps-1, each saved when due, one second apart."""
    saved = []
    for step in range(steps):
        if policy.due(step, saved):
            saved.append((step, 1000.0 + step))
    return [s for s, _ in saved], policy.kept(saved)


@pytest.mark.parametrize("interval, max_to_keep, steps, kept", [
    (1, 2, 10, [8, 9]),
    (3, 2, 17, [12, 15]),
    (2, 10, 10, [0, 2, 4, 6, 8]),
    (4, 2, 4, [0]),
])
def test_the_interval_and_max_to_keep_as_orbax(interval, max_to_keep, steps, kept):
    saved, found = run(LocalPolicy.of(LocalCheckpointOptions(
        save_interval_steps=interval, max_to_keep=max_to_keep)), steps)
    assert saved == list(range(0, steps, interval))
    assert found == kept


def test_max_to_keep_defaults_to_one_as_orbax():
    assert run(LocalPolicy.of(LocalCheckpointOptions(save_interval_steps=2)), 9)[1] == [8]


def test_should_save_fn_replaces_the_interval():
    wanted = [1, 5, 7, 8]
    saved, kept = run(LocalPolicy.of(LocalCheckpointOptions(
        should_save_fn=lambda step, _: step in wanted, max_to_keep=10)), 10)
    assert saved == kept == wanted  # no initial save at 0: Orbax's should_save_fn rule


def test_a_save_decision_policy_replaces_the_rest():
    saved, _ = run(LocalPolicy.of(LocalCheckpointOptions(
        save_interval_steps=1, max_to_keep=10,
        save_decision_policy=save_decision_policy.FixedIntervalPolicy(3))), 10)
    assert saved == [0, 3, 6, 9]


def test_a_preservation_policy_replaces_max_to_keep():
    _, kept = run(LocalPolicy.of(LocalCheckpointOptions(
        save_interval_steps=1, preservation_policy=preservation_policy.EveryNSteps(4))), 10)
    assert kept == [0, 4, 8]


def test_no_step_at_or_before_the_last_saved_one_is_due():
    policy = LocalPolicy.every(1, keep=3)
    assert not policy.due(5, [(5, 0.0)]) and not policy.due(4, [(5, 0.0)])
    assert policy.due(6, [(5, 0.0)])


def test_memory_interval_steps_keeps_the_newest():
    saved, kept = run(LocalPolicy.every(2, keep=3), 12)
    assert saved == [0, 2, 4, 6, 8, 10] and kept == [6, 8, 10]
