"""Parallel replay of a failed stage's lost steps (Swift): pure functions.

Without data-parallel peers a replacement stage replays its lost steps
alone, one microbatch after another. Its inputs are in the neighbours'
boundary logs, so the microbatches of one step do not depend on each other
until their gradients are summed: several replay workers can each take a
share of them (:func:`replay_shares`) and hand back one gradient per
microbatch. The step's gradient is then the sum the original step made,
added in the order it made it (:func:`combine_in_order`): floating-point
addition is not associative, so any other order or grouping (a per-worker
partial sum, a tree) is a different result, and the replayed run would not
be the one that never failed, bit for bit.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")


def replay_shares(microbatches: int, workers: int) -> tuple[tuple[int, ...], ...]:
    """Microbatches ``0 .. microbatches - 1`` split among ``workers``: one tuple per worker.

    Each worker's share is a contiguous run (its inputs are consecutive
    records of the same logs); shares differ in size by at most one, the
    larger first. ValueError unless ``1 <= workers <= microbatches``: a
    worker without a microbatch would only cost its start-up.
    """
    if microbatches < 1:
        raise ValueError(f"a step has at least one microbatch, not {microbatches}")
    if not 1 <= workers <= microbatches:
        raise ValueError(f"{workers} replay workers for {microbatches} microbatches: "
                         f"between 1 and {microbatches} workers each get some")
    size, larger = divmod(microbatches, workers)
    shares, start = [], 0
    for worker in range(workers):
        stop = start + size + (worker < larger)
        shares.append(tuple(range(start, stop)))
        start = stop
    return tuple(shares)


def combine_in_order(grads: Mapping[int, T], order: Sequence[int], add: Callable[[T, T], T]) -> T:
    """The step's gradient from per-microbatch ``grads``: ``add`` folded left in ``order``.

    ``order`` lists the microbatches as the original step accumulated them
    (its backward passes' order: 1F1B 0, 1, 2, ...; GPipe the reverse), and
    the result is ``add(add(grads[o0], grads[o1]), grads[o2]) ...``, the
    first gradient taken as it is: the association of a loop
    ``total = g if total is None else add(total, g)``. ValueError unless
    ``grads`` holds exactly the microbatches of ``order``, each once.
    """
    if not order:
        raise ValueError("no microbatch to combine")
    if len(set(order)) != len(order):
        raise ValueError(f"the order {list(order)} names a microbatch twice")
    if set(grads) != set(order):
        raise ValueError(f"gradients of microbatches {sorted(grads)} do not match the "
                         f"order's {sorted(order)}")
    total = grads[order[0]]
    for microbatch in order[1:]:
        total = add(total, grads[microbatch])
    return total
