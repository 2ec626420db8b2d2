"""Where one request's time goes: named phases, timed deep in the parts that do the work.

A restore's time is spent in several parts (the group's holdings, a
segment reserved, bytes arriving, checks, a record written), each a few calls
below the one that answers; handing a recorder down through every signature
would touch all of them for a measurement. ``record()`` starts one for the
calling thread's context, ``timed(name)`` adds to it wherever the work runs
in that thread, and outside a record it costs one lookup. Restore answers the
phases (``RestoreResponse.phases``) so a benchmark shows which one regressed.
"""

import contextlib
import contextvars
import time

_current: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar(
    "bubblesnap_phases", default=None)


@contextlib.contextmanager
def record():
    """Collects the phases timed inside the block: name -> seconds, in first-seen order."""
    spent: dict[str, float] = {}
    token = _current.set(spent)
    try:
        yield spent
    finally:
        _current.reset(token)


@contextlib.contextmanager
def timed(name: str):
    """Adds the block's time to phase ``name`` of the current record, if there is one."""
    spent = _current.get()
    if spent is None:
        yield
        return
    started = time.perf_counter()
    try:
        yield
    finally:
        spent[name] = spent.get(name, 0.0) + time.perf_counter() - started
