"""The segments a restore will answer with, told to its caller before the bytes are ready.

A trainer maps an answer's segment before it reads it: populating the page
tables of 256 MB takes ~12 ms with 4 KiB pages. The daemon knows the segment
early (the held copy it is about to verify, the one a peer's bytes or the
durable tier's are landing in, the one a reshard is cut into, a copy whose
runs a reshard answers where they lie), so ``RestoreStream`` tells the caller
at once and the mapping overlaps the daemon's work. The segments are chosen
several calls below the servicer, in the store and the assembler; as with
``phases``, :func:`listening` sets who hears for the calling thread's context
and :func:`announce` costs one lookup where nobody does.
"""

import contextlib
import contextvars

_current: contextvars.ContextVar = contextvars.ContextVar("bubblesnap_answer_segment",
                                                          default=None)


@contextlib.contextmanager
def listening(hear):
    """Inside the block, ``hear(path, nbytes)`` is called with every segment (and its
    size) a restore in this context chose to answer with, once each (a copy landing
    from a peer is named as it lands and again as it is served); the answer says
    which of them it uses."""
    told = set()

    def once(path: str, nbytes: int) -> None:
        if path not in told:
            told.add(path)
            hear(path, nbytes)

    token = _current.set(once)
    try:
        yield
    finally:
        _current.reset(token)


def announce(path: str, nbytes: int) -> None:
    """The restore of the calling context will answer with segment ``path`` (of
    ``nbytes``), unless it gives that segment up (a corrupt copy, the next tier)."""
    hear = _current.get()
    if hear is not None:
        hear(path, nbytes)
