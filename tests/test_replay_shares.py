"""Parallel replay of a failed stage (Swift): who takes which microbatches, and the one order
their gradients are summed in. Pure functions, no daemon."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bubblesnap.clients import combine_in_order, replay_shares


@pytest.mark.parametrize("microbatches, workers, shares", [
    (4, 1, ((0, 1, 2, 3),)),
    (4, 2, ((0, 1), (2, 3))),
    (4, 3, ((0, 1), (2,), (3,))),
    (5, 2, ((0, 1, 2), (3, 4))),
    (3, 3, ((0,), (1,), (2,))),
])
def test_each_worker_takes_a_contiguous_share_the_larger_first(microbatches, workers, shares):
    assert replay_shares(microbatches, workers) == shares


@given(st.integers(1, 64).flatmap(lambda m: st.tuples(st.just(m), st.integers(1, m))))
def test_the_shares_cover_every_microbatch_once_and_are_even(case):
    microbatches, workers = case
    shares = replay_shares(microbatches, workers)
    assert len(shares) == workers
    assert [mb for share in shares for mb in share] == list(range(microbatches))
    sizes = [len(share) for share in shares]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes,
                                                                                 reverse=True)


@pytest.mark.parametrize("microbatches, workers", [(4, 0), (4, 5), (0, 1), (-1, 1)])
def test_a_worker_without_a_microbatch_is_refused(microbatches, workers):
    with pytest.raises(ValueError):
        replay_shares(microbatches, workers)


def test_gradients_are_added_left_to_right_in_the_order_given():
    grads = {mb: f"g{mb}" for mb in range(4)}

    def add(a, b):
        return f"({a}+{b})"
    assert combine_in_order(grads, (0, 1, 2, 3), add) == "(((g0+g1)+g2)+g3)"
    assert combine_in_order(grads, (3, 2, 1, 0), add) == "(((g3+g2)+g1)+g0)"  # GPipe
    assert combine_in_order({7: "g7"}, (7,), add) == "g7"


def test_the_sum_is_the_training_loops_bit_for_bit_and_a_sum_of_shares_is_not():
    # float32 addition does not associate: 1e8 + 1 rounds back to 1e8
    values = [np.float32(v) for v in (1e8, 1.0, -1e8, 1.0)]
    total = None
    for g in values:  # how a step accumulates its microbatches' gradients
        total = g if total is None else total + g
    grads = dict(enumerate(values))
    combined = combine_in_order(grads, range(4), np.add)
    assert combined.tobytes() == total.tobytes()
    by_share = [sum(values[mb] for mb in share) for share in replay_shares(4, 2)]
    assert (by_share[0] + by_share[1]).tobytes() != total.tobytes()


@pytest.mark.parametrize("grads, order", [
    ({0: 1, 1: 2}, (0, 1, 2)),   # a microbatch's gradient missing
    ({0: 1, 1: 2, 2: 3}, (0, 1)),  # one the step did not have
    ({0: 1, 1: 2}, (0, 1, 1)),   # a microbatch named twice
    ({}, ()),
])
def test_gradients_that_do_not_match_the_order_are_refused(grads, order):
    with pytest.raises(ValueError):
        combine_in_order(grads, order, lambda a, b: a + b)
