"""One copy pulled from several peers that hold it, each sending its share of the slots at once.

With ``--replicas k`` a copy lives on several daemons, and a pull from one of
them is bound by one link (that peer's uplink, or the few TCP streams one
peer sends). Here the copy's slots are cut into contiguous groups of about
equal bytes (``data_channel.split``) and dealt round-robin to the holders;
each holder offers only its share's slots (OpenRead with ``slots``), and
every group lands straight in the one segment being installed, hashed as
its bytes land. A slot is never split, so each checksum is computed once,
over bytes that arrive in order.

A group whose pull breaks off, or whose slots do not match the checksums the
copy was described with, is pulled again from a holder that has not failed;
one that failed is not asked again. When no holder is left the fill fails
and the store keeps nothing (invariant 7).
"""

import dataclasses
import threading

import grpc

from bubblesnap.protos.checksum import SlotHasher
from bubblesnap.service import progress
from bubblesnap.service.errors import Aborted, DaemonError, reason
from bubblesnap.service.peers import data_channel


@dataclasses.dataclass(frozen=True)
class Group:
    """Contiguous slots of a copy, pulled from one holder and hashed in order."""

    first: int                           # the index of its first slot in layout order
    slots: tuple[tuple[int, int], ...]   # (offset, nbytes), offset order

    @property
    def indices(self) -> range:
        return range(self.first, self.first + len(self.slots))

    def runs(self) -> list[tuple[int, int]]:
        """Its bytes as (start, stop) runs of touching slots: one connection each (the
        alignment padding between slots is not offered, so a run ends there)."""
        runs: list[list[int]] = []
        for offset, nbytes in self.slots:
            if not nbytes:
                continue
            if runs and runs[-1][1] == offset:
                runs[-1][1] = offset + nbytes
            else:
                runs.append([offset, offset + nbytes])
        return [(a, b) for a, b in runs]


def groups(slots, nbytes: int, count: int) -> list[Group]:
    """The (offset, nbytes) ``slots`` of an ``nbytes`` segment in up to ``count`` groups."""
    found, first = [], 0
    for part in data_channel.split(slots, nbytes, count):
        if part:
            found.append(Group(first, tuple(part)))
            first += len(part)
    return found


class SpreadPull:
    """A copy's slots pulled from ``holders`` (ring indices) at once.

    ``offer(index, slots)`` asks holder ``index`` to offer those slot indices
    and returns (data address, ticket); ``pull_range(address, ticket, view,
    start, stop, received)`` reads one range of an offer into ``view``;
    ``checksums`` are the copy's, as it was described; ``on_corrupt(index,
    detail)`` hears of a holder whose bytes failed them. ``what`` names the
    copy in errors. Call :meth:`open` first, then hand :meth:`fill` to
    ``SnapshotStore.install``.
    """

    def __init__(self, holders, offer, pull_range, checksums, what: str, on_corrupt,
                 streams: int = data_channel.PULL_STREAMS):
        self._holders = list(holders)
        self._offer = offer
        self._pull_range = pull_range
        self._checksums = tuple(checksums)
        self._what = what
        self._on_corrupt = on_corrupt
        self._streams = max(streams, len(self._holders))
        self._failed: dict[int, str] = {}   # holder -> why it is not asked again
        self._dealt: list[tuple[Group, int, str, bytes]] = []
        self._landed: set[int] = set()      # holders a group landed from

    @property
    def served(self) -> list[int]:
        """The holders that sent groups which landed, in the order they were given."""
        return [h for h in self._holders if h in self._landed]

    def open(self, slots, nbytes: int) -> None:
        """Deals the groups of the copy's ``slots`` to the holders and has each offer its
        share; Aborted when none does."""
        self._dealt = self._deal(groups(slots, nbytes, self._streams))

    def fill(self, view, slots) -> tuple[int, ...]:
        """Pulls every group into ``view``; returns the slots' checksums (each matched
        what the copy was described with), or raises Aborted when no holder is left."""
        progress.expect(len(view))
        done = progress.reporter()  # the pulls run on threads of their own
        digests: dict[int, int] = {}
        dealt, self._dealt = self._dealt, []
        while dealt:
            failed = self._pull(view, dealt, digests, done)
            corrupt = {}
            for _, holder, why, bad in failed:
                self._failed.setdefault(holder, why)
                if bad:
                    corrupt.setdefault(holder, why)
            for holder, why in corrupt.items():
                self._on_corrupt(holder, why)
            dealt = self._deal([group for group, _, _, _ in failed])
        return tuple(digests[i] for i in range(len(slots)))

    def _deal(self, pending: list[Group]) -> list[tuple[Group, int, str, bytes]]:
        """(group, holder, address, ticket) for each of ``pending``, round-robin over the
        holders that have not failed, each offering its share."""
        dealt = []
        while pending:
            usable = [h for h in self._holders if h not in self._failed]
            if not usable:
                raise Aborted(self._gave_up(pending))
            shares = [(h, pending[i::len(usable)]) for i, h in enumerate(usable)]
            pending = []
            for holder, share in shares:
                if not share:
                    continue
                try:
                    address, ticket = self._offer(holder, [i for g in share for i in g.indices])
                except (DaemonError, grpc.RpcError, OSError) as err:
                    self._failed[holder] = reason(err)
                    pending += share
                    continue
                dealt += [(group, holder, address, ticket) for group in share]
        return dealt

    def _pull(self, view, dealt, digests: dict[int, int], done) -> list[tuple]:
        """Pulls each dealt group on a thread of its own (the first on this one); returns
        (group, holder, why, corrupt) for each that failed."""
        failed: list[tuple] = []
        unexpected: list[BaseException] = []

        def one(group: Group, holder: int, address: str, ticket: bytes) -> None:
            hasher = SlotHasher(group.slots)

            def received(start: int, stop: int) -> None:
                hasher.feed(view, start, stop)
                done(stop - start)

            try:
                for start, stop in group.runs():
                    self._pull_range(address, ticket, view, start, stop, received)
            except OSError as err:
                failed.append((group, holder, f"pulling from {address} failed: {err}", False))
                return
            except BaseException as err:  # reported by the caller's thread
                unexpected.append(err)
                return
            got = hasher.digests()
            bad = [i for i, d in zip(group.indices, got, strict=True) if d != self._checksums[i]]
            if bad:
                failed.append((group, holder, f"slots {bad[:8]} of {self._what} do not match "
                               "their checksums", True))
                return
            digests.update(zip(group.indices, got, strict=True))
            self._landed.add(holder)

        threads = [threading.Thread(target=one, args=d, name="data-recv") for d in dealt[1:]]
        for t in threads:
            t.start()
        one(*dealt[0])
        for t in threads:
            t.join()
        if unexpected:
            raise unexpected[0]
        return failed

    def _gave_up(self, pending: list[Group]) -> str:
        slots = [i for g in pending for i in g.indices]
        tried = "; ".join(f"peer {h}: {why}" for h, why in self._failed.items())
        return (f"no peer holding {self._what} could send slots {slots[:8]}"
                f"{' ...' if len(slots) > 8 else ''}; tried: {tried}")
