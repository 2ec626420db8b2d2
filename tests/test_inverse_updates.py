"""Undoing one SGD-momentum or AdamW update recovers the previous state closely."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bubblesnap.clients.jax import UndoDecision, undo_or_restore
from bubblesnap.clients.jax.inverse_updates import (
    check_undo,
    relative_error,
    undo_adamw,
    undo_sgd_momentum,
)


def tree(seed: int, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    return {"dense": {"kernel": jnp.asarray(rng.normal(size=(64, 32)) * scale, jnp.float32),
                      "bias": jnp.asarray(rng.normal(size=(32,)) * scale, jnp.float32)},
            "embed": jnp.asarray(rng.normal(size=(128, 16)) * scale, jnp.float32)}


def run(optimizer, steps: int):
    """States after steps-1 and steps updates, and the last gradient."""
    params = tree(0)
    state = optimizer.init(params)
    for k in range(steps):
        grads = tree(100 + k, 0.1)
        before = (params, state)
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return before, (params, state), grads


def max_rel(a, b) -> float:
    """Worst tensor's max error over its largest magnitude."""
    return max(err / scale for err, scale in (
        relative_error(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                              strict=True)))


@pytest.mark.parametrize("steps", [1, 5, 50])
def test_sgd_momentum_undo(steps):
    opt = optax.sgd(0.05, momentum=0.9)
    (p0, s0), (p1, s1), g = run(opt, steps)
    p, s = undo_sgd_momentum(p1, s1, g, 0.05, 0.9)
    assert max_rel(p, p0) < 1e-6
    assert max_rel(s[0].trace, s0[0].trace) < 1e-5
    assert check_undo(opt, p, s, g, p1, s1).within_bound


@pytest.mark.parametrize("steps", [1, 5, 50])
def test_adamw_undo(steps):
    opt = optax.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4)
    (p0, s0), (p1, s1), g = run(opt, steps)
    p, s = undo_adamw(p1, s1, g, 1e-3, 0.9, 0.999, 1e-8, 1e-4)
    assert int(s[0].count) == int(s0[0].count)
    assert max_rel(p, p0) < 1e-6
    assert max_rel(s[0].mu, s0[0].mu) < 1e-5
    check = check_undo(opt, p, s, g, p1, s1)
    assert check.within_bound, check


def test_a_non_finite_or_miscounted_undo_never_passes_the_check():
    opt = optax.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4)
    _, (p1, s1), g = run(opt, 5)
    p, s = undo_adamw(p1, s1, g, 1e-3, 0.9, 0.999, 1e-8, 1e-4)
    assert check_undo(opt, p, s, g, p1, s1).within_bound
    broken = jax.tree.map(lambda x: x, p)
    broken["embed"] = broken["embed"].at[3, 4].set(jnp.nan)
    check = check_undo(opt, broken, s, g, p1, s1)
    assert not check.within_bound and check.max_rel_error == float("inf")
    uncounted = (s[0]._replace(count=s[0].count + 1), *s[1:])  # the step count not stepped back
    assert not check_undo(opt, p, uncounted, g, p1, s1).within_bound


def test_state_the_undo_does_not_step_back_is_refused():
    params = tree(0)
    masked = optax.adamw(1e-3, weight_decay=1e-2,
                         mask=jax.tree.map(lambda x: x.ndim > 1, params))
    with pytest.raises(ValueError, match="MaskedState"):
        undo_adamw(params, masked.init(params), params, 1e-3, weight_decay=1e-2)
    scheduled = optax.sgd(optax.linear_schedule(0.05, 0.0, 10), momentum=0.9)
    with pytest.raises(ValueError, match="ScaleByScheduleState"):
        undo_sgd_momentum(params, scheduled.init(params), params, 0.05, 0.9)
    with pytest.raises(ValueError, match="schedule"):
        undo_sgd_momentum(params, scheduled.init(params), params,
                          optax.linear_schedule(0.05, 0.0, 10), 0.9)


def test_bfloat16_moments_stay_bfloat16_and_their_rounding_is_measured():
    opt = optax.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4,
                      mu_dtype=jnp.bfloat16)
    _, (p1, s1), g = run(opt, 5)
    p, s = undo_adamw(p1, s1, g, 1e-3, 0.9, 0.999, 1e-8, 1e-4)
    assert jax.tree.map(lambda x: x.dtype, s) == jax.tree.map(lambda x: x.dtype, s1)
    check = check_undo(opt, p, s, g, p1, s1)
    assert check.max_rel_error > 0  # bfloat16 rounding shows; the caller's bound decides


SGD = {"learning_rate": 0.05, "momentum": 0.9}


def test_one_update_ahead_is_undone_and_checked():
    opt = optax.sgd(**SGD)
    (p0, _), (p1, s1), g = run(opt, 5)
    decision = undo_or_restore(opt, functools.partial(undo_sgd_momentum, **SGD), p1, s1, g,
                               updates_ahead=1, bound=1e-5)
    assert isinstance(decision, UndoDecision)
    assert decision.undone and not decision.falls_back and decision.fallback_reason == ""
    assert decision.check == check_undo(opt, decision.params, decision.opt_state, g, p1, s1)
    assert decision.check.within_bound
    assert max_rel(decision.params, p0) < 1e-6


def test_an_undo_past_the_bound_is_kept_for_measuring_but_falls_back():
    opt = optax.sgd(**SGD)
    _, (p1, s1), g = run(opt, 5)
    decision = undo_or_restore(opt, functools.partial(undo_sgd_momentum, **SGD), p1, s1, g,
                               updates_ahead=1, bound=0.0)
    assert decision.undone and decision.falls_back
    assert not decision.check.within_bound and decision.check.max_rel_error > 0
    assert decision.fallback_reason == (f"undo error {decision.check.max_rel_error:.3g} > "
                                        "bound 0.0")
    undone_params, _ = undo_sgd_momentum(p1, s1, g, **SGD)
    assert max_rel(decision.params, undone_params) == 0


def test_nothing_ahead_keeps_the_state_as_it_is():
    opt = optax.sgd(**SGD)
    _, (p1, s1), g = run(opt, 3)
    decision = undo_or_restore(opt, None, p1, s1, g, updates_ahead=0)
    assert (decision.params, decision.opt_state) == (p1, s1)
    assert not decision.undone and not decision.falls_back and decision.check is None


@pytest.mark.parametrize("ahead", [2, -1])
def test_more_than_one_update_ahead_falls_back(ahead):
    opt = optax.sgd(**SGD)
    _, (p1, s1), g = run(opt, 3)
    decision = undo_or_restore(opt, functools.partial(undo_sgd_momentum, **SGD), p1, s1, g,
                               updates_ahead=ahead)
    assert decision.falls_back and not decision.undone and decision.check is None
    assert f"{ahead} updates ahead" in decision.fallback_reason
    assert (decision.params, decision.opt_state) == (p1, s1)


def test_no_inverse_or_a_refused_state_falls_back_without_an_undo():
    opt = optax.adafactor(1e-2)
    params = tree(0)
    decision = undo_or_restore(opt, None, params, opt.init(params), params, updates_ahead=1)
    assert decision.falls_back and not decision.undone and decision.check is None
    assert "no inverse" in decision.fallback_reason
    scheduled = optax.sgd(optax.linear_schedule(0.05, 0.0, 10), momentum=0.9)
    decision = undo_or_restore(scheduled, functools.partial(undo_sgd_momentum, **SGD), params,
                               scheduled.init(params), params, updates_ahead=1)
    assert decision.falls_back and not decision.undone
    assert "ScaleByScheduleState" in decision.fallback_reason
