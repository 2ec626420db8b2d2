"""A Restore call as the client makes it: ``RestoreStream``, the answer's segments mapped
while the daemon still works on them.

The daemon names each segment it will answer with as soon as it knows it (the
held copy it is about to verify, the one a peer's or the durable tier's bytes
land in, the one a reshard is cut into, a copy whose runs a reshard answers as
they lie). Mapping 256 MB takes ~12 ms with 4 KiB pages; done meanwhile, the
answer finds its pages mapped. Nothing is read from a segment before the
answer: its bytes are ready only then.
"""

import time

import grpc
import numpy as np

from bubblesnap.clients._restore_progress import restore_progress
from bubblesnap.clients._shared_memory import map_restored
from bubblesnap.clients.results import RestoreError
from bubblesnap.protos import daemon_pb2 as pb

#: A restore the daemon answered UNAVAILABLE is tried again for this long, the pauses
#: between tries doubling from the first to the most.
_RETRY_WINDOW_SECONDS, _RETRY_FIRST_SECONDS, _RETRY_MOST_SECONDS = 30.0, 0.2, 2.0


class AnswerMapping:
    """The segments a restore will answer with, mapped early; ``seconds`` spent on them."""

    def __init__(self):
        self._views: dict[str, np.ndarray] = {}
        self.seconds = 0.0

    def early(self, path: str) -> None:
        """Maps ``path``; one that cannot be mapped now is left to :meth:`answer`."""
        if path in self._views:
            return
        started = time.perf_counter()
        try:
            self._views[path] = map_restored(path)
        except OSError:  # gone already (a corrupt copy given up): the answer names another
            pass
        self.seconds += time.perf_counter() - started

    def answer(self, paths) -> list[np.ndarray]:
        """The mappings of the answer's segments, in order: those mapped early, the rest
        now (FileNotFoundError when one is gone). Early ones not named are dropped."""
        views = [self._views.get(path) for path in paths]
        self._views.clear()
        return [map_restored(path) if view is None else view
                for path, view in zip(paths, views, strict=True)]


def restore_call(stub, request, options):
    """(the RestoreResponse, read-only views of its segments as ``Slot.segment`` counts
    them, phases: ``call``, ``map_early``, ``map`` and the daemon's as
    ``daemon.<name>``); raises RestoreError. ``options``: the session's ``ClientOptions``."""
    started = time.perf_counter()
    mapping, found, pause = AnswerMapping(), None, _RETRY_FIRST_SECONDS
    while True:
        try:
            with restore_progress(stub, request.job, request.rank, options.show_progress):
                found = _answer(stub, request, options.restore_timeout_seconds, mapping)
            break
        except grpc.RpcError as err:
            # the daemon answered that a holder of the copies did not answer now (a peer
            # busy or just replaced): asked again for a while; a step-less restore gets
            # the same resume's step again (service/peers/resume_rule.py). A daemon that
            # does not answer itself fails the restore at once (callers fall back).
            if err.code() != grpc.StatusCode.UNAVAILABLE or not _answers(stub, request, options) \
                    or time.perf_counter() - started + pause > min(
                        _RETRY_WINDOW_SECONDS, options.restore_timeout_seconds):
                raise RestoreError(f"daemon {options.daemon}: {err.code().name}: "
                                   f"{err.details()}") from None
            time.sleep(pause)
            pause = min(pause * 2, _RETRY_MOST_SECONDS)
    if found is None:
        raise RestoreError(f"daemon {options.daemon} ended the restore without an answer; "
                           "restore again")
    segment_count = 1 + len(found.other_segments)
    if any(not 0 <= slot.segment < segment_count for slot in found.slots):
        raise RestoreError(f"daemon {options.daemon} answered a slot in a segment it did not "
                           "name; restore again")
    answered = time.perf_counter()
    try:
        segments = mapping.answer([found.segment_path, *found.other_segments])
    except FileNotFoundError:
        raise RestoreError(f"step {found.step} was deleted while it was being restored; "
                           "restore again") from None
    return found, segments, {"call": answered - started, "map_early": mapping.seconds,
                            "map": time.perf_counter() - answered,
                            **{f"daemon.{p.name}": p.seconds for p in found.phases}}


def _answers(stub, request, options) -> bool:
    """Whether the daemon itself answers now (its Status of the job)."""
    try:
        stub.Status(pb.StatusRequest(job=request.job), timeout=options.rpc_timeout_seconds)
        return True
    except grpc.RpcError:
        return False


def _answer(stub, request, timeout: float, mapping: AnswerMapping):
    """The RestoreResponse (None if the stream ended without one), the segments named
    before it mapped meanwhile; a daemon without RestoreStream (an older one) is asked
    with Restore, whose answer is one segment."""
    try:
        for update in stub.RestoreStream(request, timeout=timeout):
            if update.HasField("segment"):
                mapping.early(update.segment.path)
            else:
                return update.restored
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
        return stub.Restore(request, timeout=timeout)
    return None
