"""One copy moving between two daemons: offered on the data channel, pulled into the store.

The sender pins its copy and hands out a ticket (in a ``Replicate`` call it
makes, or in its answer to ``OpenRead``); the receiver pulls the bytes over
the data channel straight into a segment of its own, hashing them as they
land, and the store keeps the copy only if every checksum matches.
"""

import dataclasses

from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.service import phases
from bubblesnap.service.errors import DataLoss, InvalidArgument
from bubblesnap.service.peers import data_channel
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
            ranges = [(pinned.slots[s][2], pinned.slots[s][2] + pinned.slots[s][3])
                      for s in sorted(set(slots))]
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

    def fetch(self, index: int, job: str, world_size: int, rank: int, step: int,
              group: tuple[int, ...]) -> None:
        """Pulls peer ``index``'s copy of ``step`` of ``rank`` to serve a restore here."""
        with phases.timed("open"):
            answer = self._group.call(index, "OpenRead",
                                      ppb.OpenReadRequest(job=job, rank=rank, step=step))
        layout = layout_lib.build_layout(answer.tensors)
        if layout.segment_bytes != answer.segment_bytes:
            raise DataLoss(f"peer {index} offered {answer.segment_bytes} bytes for a "
                           f"{layout.segment_bytes}-byte layout")
        self.pull(answer.data_address, answer.ticket, job, world_size, rank, step, layout,
                  answer.checksums, group, for_restore=True)
