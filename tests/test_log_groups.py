"""Selective boundary logging (Swift's greedy merging of stage groups): pure functions."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bubblesnap.clients import plan_log_groups, trade_off


def test_everything_is_logged_when_the_budget_allows():
    plan = plan_log_groups([100, 100], [1.0, 1.0, 1.0], budget_bytes=200)
    assert plan.groups == ((0,), (1,), (2,))
    assert plan.logged_boundaries == (0, 1) and plan.log_bytes_per_step == 200
    assert plan.group_of(1) == (1,)


def test_the_biggest_boundary_goes_first_when_stages_cost_the_same():
    plan = plan_log_groups([10, 1000, 10], [1.0] * 4, budget_bytes=100)
    assert plan.groups == ((0,), (1, 2), (3,))
    assert plan.logged_boundaries == (0, 2) and plan.log_bytes_per_step == 20
    assert plan.group_of(2) == (1, 2)


def test_cheap_stages_are_merged_before_expensive_ones():
    # equal boundaries: merging the two fast stages adds the least replay time
    plan = plan_log_groups([50, 50, 50], [5.0, 5.0, 0.1, 0.1], budget_bytes=100)
    assert plan.groups == ((0,), (1,), (2, 3))


def test_a_budget_of_nothing_rolls_back_the_whole_pipeline():
    plan = plan_log_groups([10, 20], [1.0, 2.0, 3.0], budget_bytes=0)
    assert plan.groups == ((0, 1, 2),) and plan.log_bytes_per_step == 0


def test_bad_profiles_are_refused():
    with pytest.raises(ValueError, match="3 stages have 2 boundaries"):
        plan_log_groups([1], [1.0, 1.0, 1.0], 0)
    with pytest.raises(ValueError, match="negative"):
        plan_log_groups([-1, 1], [1.0, 1.0, 1.0], 0)
    with pytest.raises(ValueError, match="budget_bytes -1 is negative"):
        plan_log_groups([1, 1], [1.0, 1.0, 1.0], -1)
    with pytest.raises(ValueError, match="stage 3 is not one"):
        plan_log_groups([1, 1], [1.0, 1.0, 1.0], 0).group_of(3)


@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=8).flatmap(
    lambda times: st.tuples(st.just(times), st.lists(st.integers(0, 10**6),
                                                     min_size=len(times) - 1,
                                                     max_size=len(times) - 1))),
       st.integers(1, 8))
def test_trade_off_trades_log_bytes_for_replay_time(profile, microbatches):
    times, sizes = profile
    plans = trade_off(sizes, times, microbatches)
    assert plans[0].groups == tuple((s,) for s in range(len(times)))
    assert plans[-1].groups == (tuple(range(len(times))),)
    assert plans[-1].log_bytes_per_step == 0
    for before, after in itertools.pairwise(plans):
        assert len(after.groups) == len(before.groups) - 1
        assert after.log_bytes_per_step <= before.log_bytes_per_step
        assert after.expected_replay_seconds_per_step >= \
            before.expected_replay_seconds_per_step - 1e-9
    for plan in plans:
        assert [s for g in plan.groups for s in g] == list(range(len(times)))
        assert plan.log_bytes_per_step == sum(sizes[b] for b in plan.logged_boundaries)


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=7), st.integers(0, 5000))
def test_the_plan_fits_the_budget_with_as_few_merges_as_the_path_allows(sizes, budget):
    times = [1.0] * (len(sizes) + 1)
    plan = plan_log_groups(sizes, times, budget)
    path = trade_off(sizes, times)
    assert plan in path
    assert plan.log_bytes_per_step <= budget or len(plan.groups) == 1
    earlier = path[:path.index(plan)]
    assert all(p.log_bytes_per_step > budget for p in earlier)
