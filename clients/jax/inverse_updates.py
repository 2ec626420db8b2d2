"""Undoing one optimizer update (Swift): a data-parallel survivor one step ahead steps back.

When a data-parallel worker fails, its replicas already hold its state, but a
survivor may have applied one more update than the step the job resumes
from. SGD with momentum and Adam/AdamW can be inverted given that update's
gradient (which every replica has, after the all-reduce), so the survivor
computes its previous state instead of loading a snapshot.

Inversion is exact in real numbers and close in floating point: each
function returns the recovered state and ``check_undo`` re-applies the
update to it and measures how far that lands from the state it started
from: the rounding error of the undo. When it passes a bound (or the
optimizer has no inverse here), fall back to the snapshot and the training
log; :func:`undo_or_restore` makes that whole decision. The check cannot
tell a wrong gradient: undoing with any gradient and redoing with the same
one lands back where it started, so the gradient must be the one the update
used (the all-reduced gradient every replica holds).

The functions work on optax's own states: ``optax.sgd(lr, momentum)``
(``(TraceState, EmptyState)``) and ``optax.adamw(...)`` / ``optax.adam``
(``(ScaleByAdamState, EmptyState, ...)``), with the hyperparameters they were
built with. Any other state in the chain (a weight-decay mask, a learning-rate
schedule's step count) is refused with ValueError: the undo would not step it
back, so fall back instead.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class UndoCheck:
    """How well an undo reproduces the state it started from when re-applied.

    Attributes:
      max_abs_error: largest |redo(undo(s)) - s| over every parameter and moment.
      max_rel_error: the largest, over tensors, of that tensor's max error
        divided by its largest magnitude (elements near zero would make an
        elementwise ratio meaningless).
      within_bound: max_rel_error <= the bound asked for.
    """

    max_abs_error: float
    max_rel_error: float
    within_bound: bool


def undo_sgd_momentum(params, opt_state, grads, learning_rate: float, momentum: float):
    """(params, opt_state) before the ``optax.sgd(learning_rate, momentum)`` update that
    used ``grads`` and produced ``params``, ``opt_state`` (no Nesterov)."""
    if not momentum:
        raise ValueError("SGD without momentum keeps no state: undo with params + lr * grads")
    trace_state, *rest = opt_state
    _check_known(learning_rate, rest)
    trace = trace_state.trace
    params_before = jax.tree.map(lambda p, t: p + learning_rate * t, params, trace)
    trace_before = jax.tree.map(lambda t, g: (t - g) / momentum, trace, grads)
    return params_before, (trace_state._replace(trace=trace_before), *rest)


def undo_adamw(params, opt_state, grads, learning_rate: float, b1: float = 0.9,
               b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4):
    """(params, opt_state) before the ``optax.adamw`` update (``eps_root=0``, no mask,
    a constant learning rate) that used ``grads``; ``weight_decay=0`` is Adam."""
    adam, *rest = opt_state
    _check_known(learning_rate, rest)
    count = adam.count
    mu_hat_scale = 1 / (1 - b1 ** count.astype(jnp.float32))
    nu_hat_scale = 1 / (1 - b2 ** count.astype(jnp.float32))

    def step_back(p, m, v):
        direction = (m * mu_hat_scale) / (jnp.sqrt(v * nu_hat_scale) + eps)
        return ((p + learning_rate * direction) / (1 - learning_rate * weight_decay)).astype(
            p.dtype)

    params_before = jax.tree.map(step_back, params, adam.mu, adam.nu)
    # Moments keep their dtype (optax's mu_dtype may be bfloat16): the undone state
    # must fit the jitted update that made it.
    mu_before = jax.tree.map(lambda m, g: ((m - (1 - b1) * g) / b1).astype(m.dtype),
                             adam.mu, grads)
    # Rounding can leave a tiny negative second moment where it was ~0.
    nu_before = jax.tree.map(
        lambda v, g: jnp.maximum((v - (1 - b2) * g * g) / b2, 0.0).astype(v.dtype),
        adam.nu, grads)
    adam_before = adam._replace(count=count - 1, mu=mu_before, nu=nu_before)
    return params_before, (adam_before, *rest)


def check_undo(optimizer: optax.GradientTransformation, params_before, state_before, grads,
               params_after, state_after, bound: float = 1e-5) -> UndoCheck:
    """Re-applies ``optimizer`` to an undone state and compares with where it came from.

    A non-finite value where the original had a finite one, or a step count
    that differs, is an infinite error: such an undo never passes."""
    updates, state_redo = optimizer.update(grads, state_before, params_before)
    params_redo = optax.apply_updates(params_before, updates)
    got = jax.tree.leaves((params_redo, state_redo))
    want = jax.tree.leaves((params_after, state_after))
    abs_err = rel_err = 0.0
    for a, b in zip(got, want, strict=True):
        a, b = jnp.asarray(a), jnp.asarray(b)
        if not b.size:
            continue
        err, scale = relative_error(a, b)
        abs_err, rel_err = max(abs_err, err), max(rel_err, err / scale)
    return UndoCheck(abs_err, rel_err, rel_err <= bound)


def relative_error(a, b) -> tuple[float, float]:
    """(max |a - b|, max |b| or a tiny floor) of two arrays; integer arrays (step
    counts) must be equal, and NaN or inf where ``b`` is finite is an infinite error."""
    if not jnp.issubdtype(b.dtype, jnp.floating):
        return (0.0 if bool(jnp.array_equal(a, b)) else math.inf), 1.0
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    finite = jnp.isfinite(b)
    if not bool(jnp.all(jnp.isfinite(a) | ~finite)):
        return math.inf, 1.0
    err = float(jnp.max(jnp.where(finite, jnp.abs(a - b), 0.0)))
    return err, max(float(jnp.max(jnp.abs(jnp.where(finite, b, 0.0)))), 1e-30)


@dataclasses.dataclass(frozen=True)
class UndoDecision:
    """How a data-parallel survivor gets back to the step the job resumes from.

    Attributes:
      params, opt_state: the survivor's state at that step when an undo ran
        (its result, even when rejected) or none was needed; otherwise the
        state it was given.
      undone: an undo ran; ``check`` holds check_undo's numbers.
      check: the :class:`UndoCheck` of the undo, None when none ran.
      fallback_reason: why to restore the snapshot and replay the training log
        instead; empty when ``params``, ``opt_state`` are the state to go on with.
    """

    params: object
    opt_state: object
    undone: bool
    check: UndoCheck | None
    fallback_reason: str

    @property
    def falls_back(self) -> bool:
        """Whether the job restores the snapshot and replays the log instead."""
        return bool(self.fallback_reason)


def undo_or_restore(optimizer: optax.GradientTransformation, undo, params, opt_state, grads,
                    updates_ahead: int, bound: float = 1e-5) -> UndoDecision:
    """Undo the survivor's last update, or fall back to the snapshot and the training log.

    ``updates_ahead``: how many updates the survivor applied past the step
    the job resumes from. ``undo(params, opt_state, grads)`` steps
    ``optimizer``'s update back (:func:`undo_sgd_momentum` or
    :func:`undo_adamw` with the hyperparameters, e.g. through
    ``functools.partial``), or is None when the optimizer has no inverse
    here; ``grads`` is the gradient that update used.

    Nothing ahead: the state is the job's already. One ahead: it is undone
    and checked with :func:`check_undo` against ``bound``; an undo that
    refuses the state (ValueError: a mask, a schedule) or misses the bound
    falls back. More than one ahead always falls back: only one update can be
    undone."""
    if updates_ahead == 0:
        return UndoDecision(params, opt_state, False, None, "")
    if updates_ahead != 1:
        return UndoDecision(params, opt_state, False, None,
                            f"{updates_ahead} updates ahead of the job; only one can be undone")
    if undo is None:
        return UndoDecision(params, opt_state, False, None,
                            "the optimizer has no inverse update here")
    try:
        params_before, state_before = undo(params, opt_state, grads)
    except ValueError as err:
        return UndoDecision(params, opt_state, False, None, str(err))
    check = check_undo(optimizer, params_before, state_before, grads, params, opt_state, bound)
    reason = "" if check.within_bound else (f"undo error {check.max_rel_error:.3g} > "
                                            f"bound {bound}")
    return UndoDecision(params_before, state_before, True, check, reason)


def _check_known(learning_rate, rest) -> None:
    """Refuses what the undo would leave one step ahead."""
    if callable(learning_rate):
        raise ValueError("a learning-rate schedule is not undone here (its step count would "
                         "stay ahead): fall back to the snapshot and the training log")
    unknown = [type(s).__name__ for s in rest if not isinstance(s, optax.EmptyState)]
    if unknown:
        raise ValueError(f"optimizer state {unknown} is not undone here (a weight-decay mask, "
                         "a schedule's count, ...): fall back to the snapshot and the "
                         "training log")
