"""One step's state on its way into the daemon's memory, a piece at a time (bubble snapshots).

A :class:`PendingStep` holds the arrays of the step, the segment the daemon
reserved for it (once BeginStep answered), how far each slot is copied and
the running checksum of each slot. Copies may stop anywhere (the bubble
ended) and go on later from there.
"""

import dataclasses

import numpy as np

from bubblesnap.clients.jax import _transfer
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.protos.checksum import copy_hashing, new_hasher


@dataclasses.dataclass
class PendingStep:
    """One step's state being fetched over the bubbles of later iterations."""

    step: int
    leaves: list
    specs: list
    slot_of: dict          # (tensor, shard) -> slot index
    tensor_of_slot: list   # slot index -> tensor index
    started: float
    begun: object          # waits for the BeginStep answer (a PendingStaging or Begun)
    staging: object = None
    host: dict = dataclasses.field(default_factory=dict)  # tensor -> flat uint8 per shard
    progress: list = dataclasses.field(default_factory=list)
    hashers: list = dataclasses.field(default_factory=list)
    usage: pb.BubbleUsage = dataclasses.field(default_factory=pb.BubbleUsage)

    @classmethod
    def of(cls, step: int, leaves, specs, started: float, begun) -> "PendingStep":
        """A step nothing of which is copied yet: one slot per shard, in spec order."""
        slot_of, tensor_of_slot = {}, []
        for t, spec in enumerate(specs):
            for s in range(len(spec.shards)):
                slot_of[(t, s)] = len(tensor_of_slot)
                tensor_of_slot.append(t)
        return cls(step, leaves, specs, slot_of, tensor_of_slot, started, begun,
                   progress=[0] * len(tensor_of_slot),
                   hashers=[new_hasher() for _ in tensor_of_slot])

    def fetch(self, tensors) -> None:
        """Device-to-host transfer of ``tensors`` not fetched yet, as one batch."""
        missing = sorted(t for t in tensors if t not in self.host)
        if missing:
            host = _transfer.fetch_to_host([self.leaves[t] for t in missing])
            for t in missing:
                count = len(self.specs[t].shards)
                self.host[t], host = host[:count], host[count:]

    def copy(self, slot: int, stop: int, arrived=None) -> int:
        """Copies slot ``slot`` from where it stands up to byte ``stop``; returns bytes copied.

        Stops early when ``arrived()`` turns true (the bubble is over).
        """
        if self.staging is None:
            self.staging = self.begun()
        offset, nbytes = self.staging.slots[slot]
        start, stop = self.progress[slot], min(stop, nbytes)
        if stop <= start:
            return 0
        tensor = self.tensor_of_slot[slot]
        self.fetch({tensor})
        source = self.host[tensor][slot - self.slot_of[(tensor, 0)]]
        if arrived is not None and arrived():
            return 0
        copied = copy_hashing(self.staging.segment[offset + start:offset + stop],
                              source[start:stop], self.hashers[slot], arrived)
        self.progress[slot] = start + copied
        return copied

    def copy_rest(self) -> int:
        """Fetches and copies everything not copied yet; returns bytes copied."""
        self.fetch(range(len(self.specs)))
        return sum(self.copy(slot, np.iinfo(np.int64).max) for slot in range(len(self.progress)))

    def complete(self) -> bool:
        """Whether every slot is copied whole."""
        return self.staging is not None and all(
            p == s[1] for p, s in zip(self.progress, self.staging.slots, strict=True))

    def checksums(self) -> list[int]:
        """The checksum of each slot, in slot order (final once :meth:`complete`)."""
        return [h.intdigest() for h in self.hashers]


class Begun:
    """A step already begun (by the previous commit): looks like a BeginStep answered."""

    def __init__(self, staging):
        self._staging = staging

    def done(self) -> bool:
        return True

    def ready(self, give_up) -> bool:
        return True

    def __call__(self):
        return self._staging
