"""Retention and durable-tier policies are pure: tested on crafted holdings, no daemon."""

import pytest

from bubblesnap.service.durable.policy import (
    DurableOptions,
    is_whole,
    should_write,
    steps_to_retire,
)
from bubblesnap.service.store.retention import HeldStep, beyond_cap, oldest_kept, steps_to_free

LOCAL, STAGING, REPLICATED = HeldStep(True), HeldStep(False), HeldStep(True, replicated=True)


def test_committed_steps_below_the_kept_ones_go_unfinished_copies_too():
    steps = {1: LOCAL, 2: LOCAL, 3: STAGING, 4: LOCAL, 5: STAGING}
    assert oldest_kept([1, 2, 4], 2) == 2
    assert steps_to_free(steps, [1, 2, 4], keep_steps=2, capped=False) == {1}
    assert steps_to_free(steps, [1, 2, 4], keep_steps=1, capped=False) == {1, 2, 3}
    assert steps_to_free(steps, [], keep_steps=1, capped=False) == set()
    assert oldest_kept([], 2) == -1


def test_a_group_that_commits_nothing_cannot_grow_a_ranks_memory():
    steps = {s: LOCAL for s in range(10)}
    # keep_steps + 2 newest LOCAL copies stay when nothing is committed
    assert beyond_cap(steps, 2) == set(range(6))
    assert steps_to_free(steps, [], keep_steps=2, capped=True) == set(range(6))
    # the newest replicated ones stay too: they may still be committed
    steps.update({1: REPLICATED, 3: REPLICATED})
    assert beyond_cap(steps, 2) == {0, 2, 4, 5}
    # and the group's kept committed steps are never capped away
    assert steps_to_free(steps, [0, 2], keep_steps=2, capped=True) == {4, 5}


def test_unfinished_copies_are_not_capped():
    steps = {s: STAGING for s in range(10)}
    assert beyond_cap(steps, 1) == set()


def test_durable_writes_common_steps_and_keeps_whole_ones():
    options = DurableOptions(directory="/x", every_steps=4, every_seconds=10.0)
    assert should_write(8, 0.0, options) and not should_write(9, 0.0, options)
    assert should_write(9, 10.0, options)
    # a replica group is written once, by its copier
    assert is_whole(3, {0: (0, 1), 2: ()})
    assert not is_whole(3, {0: (0,), 2: ()})
    assert steps_to_retire([0, 2, 4, 6], whole_steps=[2, 6], keep=2) == [0]
    assert steps_to_retire([0, 2], whole_steps=[], keep=1) == []


@pytest.mark.parametrize("kwargs, words", [
    (dict(every_steps=-1), "DurableOptions.every_steps: --durable-every-steps must be >= 0"),
    (dict(keep=0), "DurableOptions.keep: --durable-keep must be at least 1"),
    (dict(write_batch_bytes=0), "DurableOptions.write_batch_bytes: --durable-write-batch"),
])
def test_durable_options_name_the_option(kwargs, words):
    with pytest.raises(ValueError, match=words):
        DurableOptions(**kwargs)


def test_the_cap_spares_a_copy_the_group_may_be_committing_right_now():
    steps = {s: HeldStep(True, local_since=float(s)) for s in range(10)}
    # at t=9.5 with a 3 s grace, steps 7..9 are recent: beyond the cap are 0..5, but
    # only those LOCAL since 6.5 or earlier go
    assert steps_to_free(steps, [], keep_steps=2, capped=True, now=9.5,
                         grace_seconds=3.0) == set(range(6))
    assert steps_to_free(steps, [], keep_steps=2, capped=True, now=4.5,
                         grace_seconds=3.0) == {0, 1}


def test_the_cap_counts_its_grace_from_the_last_copy_of_the_step_the_group_showed():
    # Step 3 landed here long ago, but its last copy landed elsewhere at t=8 (the step
    # only became whole then): another daemon may report it committed before this one
    # gathers again, so it is spared until the grace passed from then.
    steps = {s: HeldStep(True, local_since=float(s)) for s in range(10)}
    steps[3] = HeldStep(True, local_since=3.0, group_changed=8.0)
    assert 3 not in steps_to_free(steps, [], keep_steps=2, capped=True, now=9.5,
                                  grace_seconds=3.0)
    assert 3 in steps_to_free(steps, [], keep_steps=2, capped=True, now=11.0,
                              grace_seconds=3.0)
