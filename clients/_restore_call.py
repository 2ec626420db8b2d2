"""A Restore call as the client makes it: ``RestoreStream``, the answer's segment mapped
while the daemon still works on it.

The daemon names the segment it will answer with as soon as it knows it (the
held copy it is about to verify, the one a peer's or the durable tier's bytes
land in, the one a reshard is cut into). Mapping 256 MB takes ~12 ms with 4
KiB pages; done meanwhile, the answer finds its pages mapped. Nothing is read
from the segment before the answer: its bytes are ready only then.
"""

import time

import grpc
import numpy as np

from bubblesnap.clients._restore_progress import restore_progress
from bubblesnap.clients._shared_memory import map_restored
from bubblesnap.clients.results import RestoreError


class AnswerMapping:
    """The segment a restore will answer with, mapped early; ``seconds`` spent on it."""

    def __init__(self):
        self._path: str | None = None
        self._view: np.ndarray | None = None
        self.seconds = 0.0

    def early(self, path: str) -> None:
        """Maps ``path`` (a later one replaces it); one that cannot be mapped now is left
        to :meth:`answer`."""
        if path == self._path:
            return
        started = time.perf_counter()
        self._path, self._view = None, None
        try:
            self._view, self._path = map_restored(path), path
        except OSError:  # gone already (a corrupt copy given up): the answer names another
            pass
        self.seconds += time.perf_counter() - started

    def answer(self, path: str) -> np.ndarray:
        """The mapping of the answer's segment: the early one when it is that, else a new
        one (FileNotFoundError when the segment is gone)."""
        view = self._view if path == self._path else map_restored(path)
        self._path, self._view = None, None
        return view


def restore_call(stub, request, options):
    """(the RestoreResponse, a read-only view of its segment, phases: ``call``,
    ``map_early``, ``map`` and the daemon's as ``daemon.<name>``); raises RestoreError.
    ``options``: the session's ``ClientOptions``."""
    started = time.perf_counter()
    mapping = AnswerMapping()
    try:
        with restore_progress(stub, request.job, request.rank, options.show_progress):
            for update in stub.RestoreStream(request, timeout=options.restore_timeout_seconds):
                if update.HasField("segment"):
                    mapping.early(update.segment.path)
                else:
                    found = update.restored
    except grpc.RpcError as err:
        raise RestoreError(f"daemon {options.daemon}: {err.code().name}: "
                           f"{err.details()}") from None
    answered = time.perf_counter()
    try:
        segment = mapping.answer(found.segment_path)
    except FileNotFoundError:
        raise RestoreError(f"step {found.step} was deleted while it was being restored; "
                           "restore again") from None
    return found, segment, {"call": answered - started, "map_early": mapping.seconds,
                            "map": time.perf_counter() - answered,
                            **{f"daemon.{p.name}": p.seconds for p in found.phases}}
