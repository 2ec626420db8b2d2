"""The records of a manager's items (bubblesnap/shared/checkpoint_record.py) a restore from
memory rebuilds their trees with: kept from this process's own saves, else read from the
daemons (the record is a tensor of the item's snapshot)."""

import collections
import re

import jax
import numpy as np

from bubblesnap.clients.results import RestoreError
from bubblesnap.shared import checkpoint_record

#: Records kept of the steps this process saved (a restore of them asks none of the daemon).
_KEPT = 16
#: How the daemon refuses a tensor asked with another size than it was saved with.
_SAVED_SIZE = re.compile(re.escape(repr(checkpoint_record.TENSOR)) +
                         r" was saved as uint8\[(\d+)\]")


class ItemRecords:
    """``client(job)``: the job's SnapshotClient; ``capacity``: the record's size
    (CheckpointManagerOptions.record_bytes)."""

    def __init__(self, client, capacity: int):
        self._client, self._capacity = client, capacity
        self._kept: collections.OrderedDict = collections.OrderedDict()

    def remember(self, job: str, step: int, record: dict) -> None:
        self._kept[(job, step)] = record
        self._kept.move_to_end((job, step))
        while len(self._kept) > _KEPT:
            self._kept.popitem(last=False)

    def record(self, job: str, step: int) -> dict | None:
        """The item record of ``step`` of ``job``: kept from this process's save, else
        read from the daemons; None when they do not hold it."""
        if (job, step) in self._kept:
            return self._kept[(job, step)]
        client, capacity = self._client(job), self._capacity
        for _ in range(2):
            try:
                found = client.restore_leaves(
                    [checkpoint_record.TENSOR],
                    [jax.ShapeDtypeStruct((capacity,), np.uint8)], step, alone=True,
                    host={checkpoint_record.TENSOR})
                record = checkpoint_record.decode(found.state[0])
            except RestoreError as err:
                saved = _SAVED_SIZE.search(str(err))
                if saved is not None and int(saved[1]) != capacity:
                    capacity = int(saved[1])  # the job was saved with another record_bytes
                    continue
                return None
            except ValueError:
                return None
            self.remember(job, step, record)
            return record
        return None
