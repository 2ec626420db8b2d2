"""What each peer answered last when asked for a job's holdings (the static ring).

A peer that misses one call but is not dead yet counts with its last answer, and the
steps a peer took as committed keep their copies on the others (replicator.py); a
peer that answered and then stopped, or was replaced, may have taken steps as
committed that nobody else heard of (``lost``).
"""

import threading

from bubblesnap.service.peers.group_view import Holding


class PeerAnswers:
    """The peers' last Holdings answers per job, and who answered each gathering."""

    def __init__(self):
        self._holdings: dict[tuple[int, str], list[Holding]] = {}
        self._committed: dict[tuple[int, str], set[int]] = {}  # as the peer took them
        self._answered: dict[str, set[int]] = {}  # job -> the peers its last gathering heard
        self._lost: set[str] = set()  # jobs a peer was lost to since lost() asked
        self._missed: dict[str, tuple[set[int], set[int]]] = {}  # job -> (silent, unknown)
        self._lock = threading.Lock()

    def heard(self, index: int, job: str, holdings: list[Holding],
              committed: set[int] = frozenset()) -> None:
        """Peer ``index`` answered for ``job`` (-1: etcd's view, read in one request)."""
        with self._lock:
            self._holdings[(index, job)] = holdings
            self._committed[(index, job)] = set(committed)

    def last(self, index: int, job: str) -> list[Holding]:
        """What peer ``index`` answered last for ``job``; [] if it never answered."""
        with self._lock:
            return list(self._holdings.get((index, job), []))

    def gathered(self, job: str, answered: set[int], silent: set[int]) -> None:
        """A gathering of ``job`` heard ``answered``; ``silent`` (not dead) did not answer."""
        with self._lock:
            if self._answered.get(job, set()) - answered:
                self._lost.add(job)
            self._answered[job] = answered
            self._missed[job] = (set(silent), {i for i in silent
                                               if (i, job) not in self._holdings})

    def unanswered(self, job: str, ever: bool = False) -> set[int]:
        """Peers not dead that missed the last gathering of ``job`` (``ever``: and never
        answered it: what they hold is not known)."""
        with self._lock:
            return set(self._missed.get(job, (set(), set()))[ever])

    def replaced(self, index: int) -> None:
        """A new daemon took position ``index``: it starts empty, and the one it replaced
        went with its copies (every job lost a peer)."""
        with self._lock:
            for key in [k for k in self._holdings if k[0] == index]:
                del self._holdings[key]
                self._committed.pop(key, None)
            self._lost |= set(self._answered)

    def committed(self, job: str) -> set[int]:
        """The steps of ``job`` the peers took as committed, as they answered last."""
        with self._lock:
            return {s for (_, name), steps in self._committed.items() if name == job
                    for s in steps}

    def lost(self, job: str) -> bool:
        """Whether a peer that answered for ``job`` was lost since this was last asked."""
        with self._lock:
            lost = job in self._lost
            self._lost.discard(job)
            return lost

    def forget(self, job: str) -> None:
        with self._lock:
            self._answered.pop(job, None)
            self._lost.discard(job)
            for key in [k for k in self._holdings if k[1] == job]:
                del self._holdings[key]
                self._committed.pop(key, None)
