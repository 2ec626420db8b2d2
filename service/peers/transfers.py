"""One copy moving between two daemons: offered on the data channel, pulled into the store.

The sender pins its copy and hands out a ticket (in a ``Replicate`` call it
makes, or in its answer to ``OpenRead``); the receiver pulls the bytes over
the data channel straight into a segment of its own, hashing them as they
land, and the store keeps the copy only if every checksum matches.
"""

from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.service.errors import DataLoss
from bubblesnap.service.peers import data_channel
from bubblesnap.service.store import layout as layout_lib
from bubblesnap.service.store.views import PinnedCopy


class Transfers:
    """Offers this daemon's copies to peers and pulls theirs into the store."""

    def __init__(self, store, group, data_server: data_channel.DataServer):
        self._store = store
        self._group = group
        self._data = data_server

    @property
    def data_address(self) -> str:
        return self._data.address

    def offer(self, job: str, rank: int, step: int) -> tuple[PinnedCopy, bytes]:
        """Pins a LOCAL copy and offers it; it is unpinned once read, cancelled or expired.
        NotFound when it is not held."""
        pinned = self._store.pin(job, rank, step)
        ticket = self._data.offer(pinned.segment.path, pinned.segment.nbytes,
                                  lambda: self._store.unpin(pinned))
        return pinned, ticket

    def cancel(self, ticket: bytes) -> None:
        """The reader will not come (its call failed): unpin now."""
        self._data.cancel(ticket)

    def pull(self, address: str, ticket: bytes, job: str, world_size: int, rank: int,
             step: int, layout: layout_lib.Layout, checksums, group: tuple[int, ...],
             for_restore: bool = False) -> int:
        """Pulls a copy offered at ``address`` under ``ticket`` into the store; the bytes
        stored (0: this very copy was held already)."""
        data_channel.check_address(address)
        options = self._group.options
        fill = data_channel.puller(address, ticket, options.security.client_ssl_context(),
                                   options.transfer_timeout_seconds,
                                   f"step {step} of rank {rank}")
        return self._store.install(job, world_size, rank, step, layout, checksums, fill,
                                   for_restore=for_restore, group=group)

    def fetch(self, index: int, job: str, world_size: int, rank: int, step: int,
              group: tuple[int, ...]) -> None:
        """Pulls peer ``index``'s copy of ``step`` of ``rank`` to serve a restore here."""
        answer = self._group.call(index, "OpenRead",
                                  ppb.OpenReadRequest(job=job, rank=rank, step=step))
        layout = layout_lib.build_layout(answer.tensors)
        if layout.segment_bytes != answer.segment_bytes:
            raise DataLoss(f"peer {index} offered {answer.segment_bytes} bytes for a "
                           f"{layout.segment_bytes}-byte layout")
        self.pull(answer.data_address, answer.ticket, job, world_size, rank, step, layout,
                  answer.checksums, group, for_restore=True)
