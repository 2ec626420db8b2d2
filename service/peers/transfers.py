"""One copy moving between two daemons: offered on the data channel, pulled into the store.

The sender pins its copy and hands out a ticket (in a ``Replicate`` call it
makes, or in its answer to ``OpenRead``); the receiver pulls the bytes over
the data channel straight into a segment of its own, hashing them as they
land, and the store keeps the copy only if every checksum matches. A copy a
restore needs that several live peers hold comes from all of them at once,
each its share of the slots (``spread.py``).
"""

import dataclasses

import grpc

from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.service import phases
from bubblesnap.service.errors import Aborted, DataLoss, InvalidArgument
from bubblesnap.service.peers import data_channel, spread
from bubblesnap.service.peers.addresses import check_address
from bubblesnap.service.peers.data_server import DataServer
from bubblesnap.service.store import layout as layout_lib
from bubblesnap.service.store.views import PinnedCopy


@dataclasses.dataclass(frozen=True)
class PeerCopy:
    """A copy a peer holds, as Describe tells it."""

    layout: layout_lib.Layout
    checksums: tuple[int, ...]
    world_size: int


class Transfers:
    """Offers this daemon's copies to peers and pulls theirs into the store."""

    def __init__(self, store, group, data_server: DataServer):
        self._store = store
        self._group = group
        self._data = data_server

    @property
    def data_address(self) -> str:
        return self._data.address

    def offer(self, job: str, rank: int, step: int,
              slots=(), gate=None) -> tuple[PinnedCopy, bytes]:
        """Pins a LOCAL copy and offers it, or only its ``slots`` (indices in layout
        order); it is unpinned once read, cancelled or expired. NotFound when it is
        not held, InvalidArgument for a slot it does not have. ``gate``: see
        :meth:`DataServer.offer` (pacing the bytes)."""
        pinned = self._store.pin(job, rank, step)
        ranges = None
        if slots:
            if not all(0 <= s < len(pinned.slots) for s in slots):
                self._store.unpin(pinned)
                raise InvalidArgument(f"the copy of step {step} of rank {rank} has "
                                      f"{len(pinned.slots)} slots; asked for {sorted(slots)[:8]}")
            ranges = _touching_joined([(pinned.slots[s][2], pinned.slots[s][2] + pinned.slots[s][3])
                                       for s in sorted(set(slots))])
        ticket = self._data.offer(pinned.segment.path, pinned.segment.nbytes,
                                  lambda: self._store.unpin(pinned), ranges, gate)
        return pinned, ticket

    def cancel(self, ticket: bytes) -> None:
        """The reader will not come (its call failed): unpin now."""
        self._data.cancel(ticket)

    def pull(self, address: str, ticket: bytes, job: str, world_size: int, rank: int,
             step: int, layout: layout_lib.Layout, checksums, group: tuple[int, ...],
             for_restore: bool = False) -> int:
        """Pulls a copy offered at ``address`` under ``ticket`` into the store; the bytes
        stored (0: this very copy was held already)."""
        options = self._group.options
        fill = data_channel.puller(address, ticket, options.security.client_ssl_context(),
                                   options.transfer_timeout_seconds,
                                   f"step {step} of rank {rank}")
        stored = self._store.install(job, world_size, rank, step, layout, checksums, fill,
                                     for_restore=for_restore, group=group)
        self._group.changed(job, self._store.holdings(job))
        return stored

    def describe(self, index: int, job: str, rank: int, step: int) -> PeerCopy:
        """The layout and checksums of peer ``index``'s copy of ``step`` of ``rank``."""
        with phases.timed("describe"):
            answer = self._group.call(index, "Describe",
                                      ppb.DescribeRequest(job=job, rank=rank, step=step))
        return PeerCopy(layout_lib.build_layout(answer.tensors), tuple(answer.checksums),
                        answer.world_size)

    def read_slots(self, index: int, job: str, rank: int, step: int,
                   slots: list[int], expected: PeerCopy) -> dict[int, bytearray]:
        """The bytes of ``slots`` of peer ``index``'s copy, each verified against the
        checksum ``expected`` (what Describe said) before it is returned; DataLoss
        for a slot that does not match, Aborted when the transfer breaks off."""
        with phases.timed("open"):
            answer = self._group.call(index, "OpenRead", ppb.OpenReadRequest(
                job=job, rank=rank, step=step, slots=slots))
        if tuple(answer.checksums) != expected.checksums:
            # Not read: the peer unpins it when the ticket expires.
            raise DataLoss(f"peer {index}'s copy of step {step} of rank {rank} changed between "
                           "Describe and OpenRead")
        where = {i: (s.offset, s.offset + s.nbytes) for i, s in enumerate(answer.slots)}
        options = self._group.options
        with phases.timed("receive"):
            got = data_channel.read_ranges(answer.data_address, answer.ticket,
                                           [where[s] for s in slots],
                                           options.security.client_ssl_context(),
                                           options.transfer_timeout_seconds,
                                           f"step {step} of rank {rank}")
        pieces = {}
        for slot, (data, digest) in zip(slots, got, strict=True):
            if digest != expected.checksums[slot]:
                raise DataLoss(f"peer {index}'s copy of step {step} of rank {rank}: slot "
                               f"{slot} does not match its checksum")
            pieces[slot] = data
        return pieces

    def pull_into(self, index: int, job: str, rank: int, step: int, expected: PeerCopy,
                  view) -> None:
        """Pulls peer ``index``'s whole copy into ``view`` (a segment of its size), every
        slot checked against the checksums ``expected`` (what Describe said); DataLoss for
        one that does not match, Aborted when the transfer breaks off."""
        with phases.timed("open"):
            answer = self._group.call(index, "OpenRead",
                                      ppb.OpenReadRequest(job=job, rank=rank, step=step))
        if tuple(answer.checksums) != expected.checksums or \
                answer.segment_bytes != expected.layout.segment_bytes:
            # Not read: the peer unpins it when the ticket expires.
            raise DataLoss(f"peer {index}'s copy of step {step} of rank {rank} changed between "
                           "Describe and OpenRead")
        options = self._group.options
        fill = data_channel.puller(answer.data_address, answer.ticket,
                                   options.security.client_ssl_context(),
                                   options.transfer_timeout_seconds, f"step {step} of rank {rank}")
        with phases.timed("receive"):
            computed = fill(view, [(o, n) for _, _, o, n in expected.layout.slots()])
        bad = [s for s, (got, want) in enumerate(zip(computed, expected.checksums, strict=True))
               if got != want]
        if bad:
            raise DataLoss(f"peer {index}'s copy of step {step} of rank {rank}: slot {bad[0]} "
                           "does not match its checksum")

    def fetch(self, indices, job: str, world_size: int, rank: int, step: int,
              group: tuple[int, ...], on_corrupt=None) -> list[int]:
        """Pulls the copy of ``step`` of ``rank`` to serve a restore here, from peer
        ``indices[0]`` alone or, given several holders, from each its share of the slots
        at once (``spread.py``; ``on_corrupt(index, detail)`` hears of a holder whose
        bytes failed their checksums, its share pulled from another). Returns the peers
        that sent it."""
        if len(indices) == 1:
            self._fetch_one(indices[0], job, world_size, rank, step, group)
            return list(indices)
        expected = self._described(indices, job, rank, step)
        options = self._group.options
        ssl_context = options.security.client_ssl_context()
        what = f"step {step} of rank {rank}"
        slots = [(o, n) for _, _, o, n in expected.layout.slots()]
        pull = spread.SpreadPull(
            indices, lambda index, share: self._open_share(index, job, rank, step, share,
                                                            expected, slots),
            lambda address, ticket, view, start, stop, received: data_channel.pull_range(
                address, ticket, view, start, stop, ssl_context,
                options.transfer_timeout_seconds, received),
            expected.checksums, what, on_corrupt or (lambda index, detail: None))
        with phases.timed("open"):
            pull.open(slots, expected.layout.segment_bytes)
        self._store.install(job, world_size, rank, step, expected.layout, expected.checksums,
                            pull.fill, for_restore=True, group=group)
        self._group.changed(job, self._store.holdings(job))
        return pull.served

    def _fetch_one(self, index: int, job: str, world_size: int, rank: int, step: int,
                   group: tuple[int, ...]) -> None:
        with phases.timed("open"):
            answer = self._group.call(index, "OpenRead",
                                      ppb.OpenReadRequest(job=job, rank=rank, step=step))
        layout = layout_lib.build_layout(answer.tensors)
        if layout.segment_bytes != answer.segment_bytes:
            raise DataLoss(f"peer {index} offered {answer.segment_bytes} bytes for a "
                           f"{layout.segment_bytes}-byte layout")
        self.pull(answer.data_address, answer.ticket, job, world_size, rank, step, layout,
                  answer.checksums, group, for_restore=True)

    def _described(self, indices, job: str, rank: int, step: int) -> PeerCopy:
        """The copy as the first of ``indices`` that answers describes it."""
        for index in indices[:-1]:
            try:
                return self.describe(index, job, rank, step)
            except grpc.RpcError:
                continue
        return self.describe(indices[-1], job, rank, step)

    def _open_share(self, index: int, job: str, rank: int, step: int, share: list[int],
                    expected: PeerCopy, slots) -> tuple[str, bytes]:
        """Peer ``index`` offers the ``share`` of slots of its copy, which must be the one
        described (``slots``: where each lies): (data address, ticket)."""
        answer = self._group.call(index, "OpenRead", ppb.OpenReadRequest(
            job=job, rank=rank, step=step, slots=share))
        if tuple(answer.checksums) != expected.checksums or \
                [(s.offset, s.nbytes) for s in answer.slots] != slots:
            # Not read: the peer unpins it when the ticket expires.
            raise Aborted(f"peer {index} holds another copy of step {step} of rank {rank} "
                          "than the one described")
        check_address(answer.data_address, "data address")
        return answer.data_address, answer.ticket


def _touching_joined(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(start, stop) ranges in order, those that touch joined: a reader of many slots in a
    row (a holder's share of a spread pull) needs a connection per run, not per slot."""
    joined: list[tuple[int, int]] = []
    for start, stop in ranges:
        if joined and joined[-1][1] == start:
            joined[-1] = (joined[-1][0], stop)
        else:
            joined.append((start, stop))
    return joined
