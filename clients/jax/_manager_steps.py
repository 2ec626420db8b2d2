"""The steps a CheckpointManager tracks (Orbax's checkpoint infos) and where each is held.

A step is tracked from its ``save`` (as in Orbax, ``latest_step`` names it at
once) or, on (re)load, because a tier holds it: committed in the daemons'
memory, or whole on disk (the daemon's folder, or one Orbax wrote). It stays
listed while a tier holds it and the preservation policy keeps it; a step
retention freed from every tier is no longer listed. Each step's record
(time, metrics, items) is read once, from the daemon, and kept.
"""

import dataclasses
import datetime
import logging
import re

import grpc
import jax
import numpy as np

from bubblesnap import checkpoint_record
from bubblesnap.clients.jax.step_metadata import step_time
from bubblesnap.clients.results import RestoreError
from bubblesnap.protos import daemon_pb2 as pb

log = logging.getLogger("bubblesnap.client")
#: How the daemon refuses a tensor asked with another size than it was saved with.
_SAVED_SIZE = re.compile(re.escape(repr(checkpoint_record.TENSOR)) +
                         r" was saved as uint8\[(\d+)\]")


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What Orbax's policies know of a step (its ``PolicyCheckpointInfo``)."""

    step: int
    time: datetime.datetime
    metrics: dict | None = None

    @classmethod
    def now(cls, step: int) -> "StepInfo":
        return cls(step, datetime.datetime.now(tz=datetime.timezone.utc))


class Steps:
    """The tracked steps of one manager, its daemon client and its StepFolders."""

    def __init__(self, client, folders, record_bytes: int, primary: bool):
        self._client, self._folders, self._record_bytes = client, folders, record_bytes
        self._primary = primary  # the process that deletes the manager's files
        self._infos: dict[int, StepInfo] = {}
        self._pending: set[int] = set()  # saved here, no tier seen holding it yet
        self._records: dict[int, dict | None] = {}
        self._asked = None  # a Status call a save sent for retire, not used yet

    def infos(self) -> list[StepInfo]:
        """The tracked steps, oldest first."""
        return [self._infos[s] for s in sorted(self._infos)]

    def known(self) -> set[int]:
        return set(self._infos)

    def add(self, info: StepInfo) -> None:
        """A step this manager just saved."""
        self._infos[info.step] = info
        self._pending.add(info.step)

    def reload(self) -> None:
        """Tracks what the tiers hold now (a new manager, or ``reload``). A step only being
        written is not one of them: its writer may be gone with its memory (a reboot), and
        then it never becomes whole; a live daemon writing it holds it committed."""
        self._records.clear()
        folders = self._folders.find()
        held = (self._committed() or set()) | set(folders)
        self._infos = {step: self._info_of(step, folders.get(step)) for step in sorted(held)}
        self._pending.clear()

    def restorable(self) -> list[int]:
        """Tracked steps some tier holds (or just saved here), oldest first; steps no tier
        holds any more are dropped, and (the primary) the items saved for them. While
        the daemon cannot be asked nothing is dropped."""
        committed = self._committed()
        if committed is None:
            return sorted(self._infos)
        held = committed | set(self._folders.find()) | self._folders.being_written()
        newest_held = max(held, default=-1)
        self._pending = {s for s in self._pending if s not in held and s > newest_held}
        gone = [s for s in self._infos if s not in held and s not in self._pending]
        for step in gone:
            del self._infos[step]
            self._records.pop(step, None)
        if gone and self._primary:
            self._folders.forget_items(keep=held | set(self._infos))
        return sorted(self._infos)

    def newest_held(self) -> int | None:
        """The newest step a tier holds now (asked afresh, not the tracked steps)."""
        return max((self._committed() or set()) | set(self._folders.find()), default=None)

    def _committed(self) -> set[int] | None:
        """Steps committed in the daemons' memory; None when the daemon cannot be asked."""
        try:
            status = self._client.status()
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return set()  # the daemon knows no such job (yet): the disk tells
            if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return None
            raise
        return {s.step for s in status.steps if s.committed}

    def _info_of(self, step: int, folder: str | None) -> StepInfo:
        metadata = self._folders.metadata_at(folder) if folder is not None else None
        if metadata is not None:  # Orbax's, or the daemon's (saved at its init time)
            nanos = metadata.get("init_timestamp_nsecs" if self._folders.is_ours(folder)
                                 else "commit_timestamp_nsecs") or 0
            return StepInfo(step, datetime.datetime.fromtimestamp(
                nanos / 1e9, tz=datetime.timezone.utc), metadata.get("metrics") or None)
        record = self.record(step)
        if record is None:
            return StepInfo.now(step)
        return StepInfo(step, step_time(record), record.get("metrics"))

    def record(self, step: int) -> dict | None:
        """The step's record (checkpoint_record.py), None for a step Orbax wrote."""
        if step not in self._records:
            self._records[step] = self._read_record(step)
        return self._records[step]

    def _read_record(self, step: int) -> dict | None:
        folder = self._folders.find().get(step)
        if folder is not None and not self._folders.is_ours(folder) and \
                step not in (self._committed() or set()):
            return None
        capacity = self._record_bytes
        for _ in range(2):
            try:
                found = self._client.restore_leaves(
                    [checkpoint_record.TENSOR],
                    [jax.ShapeDtypeStruct((capacity,), np.uint8)], step, alone=True,
                    host={checkpoint_record.TENSOR})
                return checkpoint_record.decode(found.state[0])
            except RestoreError as err:
                saved = _SAVED_SIZE.search(str(err))
                if saved is not None and int(saved[1]) != capacity:
                    capacity = int(saved[1])  # the job was saved with another record_bytes
                    continue
                if folder is not None and not self._folders.is_ours(folder):
                    return None
                if folder is not None:  # the daemon is away, or does not write this folder
                    log.warning("step %d: the daemon could not read its record (%s); reading "
                                "it from %s", step, err, folder)
                    return self._folders.record(folder)
                raise RestoreError(f"step {step}: its record could not be read: {err}") \
                    from None
        raise RestoreError(f"step {step}: its record could not be read")

    def retire(self, dropped: list[int], wait: bool) -> None:
        """Deletes the steps of ``dropped`` older than the newest step the job committed.
        ``wait``: asks the daemon now; else (a save) the question goes out without
        waiting and its answer is used at the next call: a sick daemon never holds a
        save up."""
        session = self._client.session
        asked, self._asked = self._asked, None
        if not wait and (asked is None or not asked.done()):
            self._asked = asked or session.call_async("Status", pb.StatusRequest(job=session.job))
            return
        try:
            answer = (asked if asked is not None and not wait else session.call_async(
                "Status", pb.StatusRequest(job=session.job))).result()
        except grpc.RpcError:
            return  # tried again at the next save
        latest = answer.jobs[0].latest_committed_step
        if any(step < latest for step in dropped):
            self.delete(*(step for step in dropped if step < latest), wait=wait)

    def delete(self, *steps: int, wait: bool = True) -> None:
        """Forgets ``steps`` and deletes them: this process's copies in its daemon's memory
        (one call; ``wait`` false: not waited for), and (the primary process) their
        folders and the items saved for them."""
        for step in steps:
            self._infos.pop(step, None)
            self._pending.discard(step)
            self._records.pop(step, None)

        def deleted(future) -> None:
            try:
                err = future.exception()
            except grpc.FutureCancelledError:  # the manager closed meanwhile
                return
            if isinstance(err, grpc.RpcError):  # NOT_FOUND: on disk only, or another's
                (log.debug if err.code() == grpc.StatusCode.NOT_FOUND else log.warning)(
                    "steps %s: could not delete them from the daemon's memory: %s: %s",
                    list(steps), err.code().name, err.details())
        call = self._client.session.call_async("DeleteSnapshots", pb.DeleteSnapshotsRequest(
            job=self._client.job, steps=steps))
        if wait:
            deleted(call)
        else:
            call.add_done_callback(deleted)
        if self._primary:
            for step in steps:
                self._folders.delete(step)
