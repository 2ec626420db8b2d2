"""Every rank's layout across the peer group, to judge whether job-wide arrays are covered.

Each daemon knows the ranks registered with it; coverage of a job-wide
array is a property of all of them. Register asks the peers (``Layouts``)
before it accepts a rank, so a set of layouts that can never cover is
refused where it completes; status and the replicator use a copy of that
view refreshed at most once per ``max_age`` seconds.
"""

import logging
import threading
import time

import grpc
from google.protobuf.message import DecodeError

from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.service.errors import DaemonError, NotFound
from bubblesnap.service.log_once import warn_once
from bubblesnap.service.rpc.messages import tensor_specs
from bubblesnap.service.store import layout as layout_lib
from bubblesnap.service.store.registration import Coverage, judge

log = logging.getLogger("bubblesnap.daemon")


class GroupLayouts:
    """The layouts of a job's ranks registered anywhere in the group (or here alone)."""

    def __init__(self, store, group=None, max_age: float = 1.0):
        self._store = store
        self._group = group
        self._max_age = max_age
        self._cached: dict[str, tuple[float, Coverage]] = {}
        self._lock = threading.Lock()

    def others(self, job: str, world_size: int) -> dict[int, tuple]:
        """rank -> (layout, replica group) of the ranks of ``world_size`` registered at
        peers (those that answer); empty without peers."""
        found = {}
        if self._group is None:
            return found
        for r in self._published(job) if self._group.coordinated else self._asked(job):
            if r.world_size == world_size:
                found[r.rank] = (layout_lib.build_layout(r.tensors), tuple(r.replica_group))
        return found

    def _asked(self, job: str):
        for index in self._group.ring_order_live_first():
            try:
                yield from self._group.call(index, "Layouts", ppb.LayoutsRequest(job=job)).ranks
            except grpc.RpcError:
                continue

    def _published(self, job: str):
        """With etcd: the layouts every daemon published (watched: they change only when
        ranks register, so reading them costs no call)."""
        for value in self._group.etcd_layouts(job):
            try:
                layout = ppb.RankLayout.FromString(value)
                layout_lib.build_layout(layout.tensors)
            except (DecodeError, DaemonError):
                warn_once(log, f"layout {job} {value[:80]!r}", "ignoring a layout in etcd "
                          "that no daemon wrote for job %s (said once per value)", job)
                continue
            yield layout

    def register(self, job: str, rank: int, world_size: int, layout, group):
        """Register, judged against the ranks registered here and at every peer (with
        etcd: then published there for the others to judge by)."""
        answer = self._store.register(job, rank, world_size, layout, group,
                                      others=self.others(job, world_size))
        if self._group is not None and self._group.coordinated:
            self._group.publish_layout(job, rank, ppb.RankLayout(
                rank=rank, world_size=world_size, tensors=tensor_specs(layout),
                replica_group=group).SerializeToString())
        return answer

    def coverage(self, job: str) -> Coverage:
        """How the registered ranks of the job's current epoch cover its job-wide arrays."""
        now = time.monotonic()
        with self._lock:
            cached = self._cached.get(job)
        if cached is not None and now - cached[0] < self._max_age:
            return cached[1]
        try:
            world = self._store.world_size(job)
        except NotFound:
            return Coverage(False, None, ())
        mine = {r.rank: (r.layout, r.group) for r in self._store.layouts(job)}
        coverage = judge(world, {**self.others(job, world), **mine})
        with self._lock:
            self._cached[job] = (now, coverage)
        return coverage
