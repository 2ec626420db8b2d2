"""Reading the durable tier: which steps are whole, and a written rank cut into a layout."""

import math
import os

import numpy as np

from bubblesnap.protos.checksum import checksum
from bubblesnap.service.durable import format as fmt
from bubblesnap.service.durable import policy
from bubblesnap.service.errors import DaemonError, DataLoss, FailedPrecondition
from bubblesnap.service.store import layout as layout_lib


class DurableReader:
    """Finds and loads what the daemons of a job wrote under ``directory``."""

    def __init__(self, directory: str):
        self.directory = directory

    def steps(self, job: str, world_size: int) -> list[int]:
        """Steps whose every rank is fully written, oldest first."""
        return sorted(step for step in fmt.step_numbers(self.directory, job)
                      if self._whole(job, step, world_size))

    def _whole(self, job: str, step: int, world_size: int) -> bool:
        written = fmt.written_ranks(self.directory, job, step)
        if set(written) >= set(range(world_size)):
            return True
        groups = {}  # only a grouped job (or an unfinished step) reads sidecars
        for rank in written:
            try:
                groups[rank] = tuple(self._meta(job, step, rank).get("replica_group", ()))
            except DaemonError:
                continue
        return policy.is_whole(world_size, groups)

    def world_size(self, job: str) -> int:
        """The world size the newest written rank of ``job`` recorded; 0: none written."""
        for step in sorted(fmt.step_numbers(self.directory, job), reverse=True):
            for rank in fmt.written_ranks(self.directory, job, step):
                return int(self._meta(job, step, rank)["world_size"])
        return 0

    def replica_group(self, job: str, rank: int, step: int) -> tuple[int, ...]:
        """The replica group a written rank declared (the ranks its copy holds)."""
        return tuple(self._meta(job, step, rank).get("replica_group", ())) or (rank,)

    def written_slots(self, job: str, rank: int, step: int) -> list[int] | None:
        """Slot checksums of the copy written for (job, rank, step); None if none is readable."""
        try:
            return self._meta(job, step, rank).get("slot_checksums")
        except DaemonError:
            return None

    def whole_layout(self, job: str, rank: int, step: int) -> layout_lib.Layout:
        """A layout with each tensor whole (one shard), as written."""
        meta = self._meta(job, step, rank)
        return layout_lib.Layout(tuple(
            layout_lib.Tensor(t["name"], t["dtype"], tuple(t["shape"]), (layout_lib.Shard(
                tuple((0, d) for d in t["shape"]),
                math.prod(t["shape"]) * layout_lib.ITEMSIZE[t["dtype"]]),))
            for t in meta["tensors"]))

    def load(self, job: str, rank: int, step: int, layout: layout_lib.Layout):
        """Reads a written rank and cuts it into ``layout``'s shards.

        Returns ``(fill, checksums)`` for ``SnapshotStore.install``. Every
        tensor is verified against the checksum written beside it; DataLoss
        when one does not match or the checkpoint cannot be read.
        """
        path = fmt.rank_path(self.directory, job, step, rank)
        meta = self._meta(job, step, rank)
        expected = {t["name"]: t for t in meta["tensors"]}
        registered = {t.name: (t.dtype, list(t.global_shape)) for t in layout.tensors}
        written = {name: (t["dtype"], list(t["shape"])) for name, t in expected.items()}
        if written != registered:
            differ = sorted(n for n in set(written) | set(registered)
                            if written.get(n) != registered.get(n))
            raise FailedPrecondition(
                f"{path} does not hold the registered state: tensors {differ[:4]} differ in "
                "name, dtype or shape")
        try:
            tree = fmt.orbax().StandardCheckpointer().restore(os.path.abspath(path))
        except Exception as err:  # Orbax raises many types for damaged files
            raise DataLoss(f"{path} cannot be read by Orbax: {err}") from err
        arrays = {}
        for name, meta_t in expected.items():
            array = np.ascontiguousarray(fmt.lookup(tree, name))
            if checksum(array) != meta_t["checksum"]:
                raise DataLoss(f"{path}: tensor {name!r} does not match its checksum")
            arrays[name] = array
        pieces, checksums = [], []
        for t_index, s_index, offset, nbytes in layout.slots():
            tensor = layout.tensors[t_index]
            index = tensor.shards[s_index].index
            piece = np.ascontiguousarray(arrays[tensor.name][tuple(slice(a, b) for a, b in index)])
            pieces.append((offset, nbytes, piece))
            checksums.append(checksum(piece))

        def fill(view, slots):
            for offset, nbytes, piece in pieces:
                view[offset:offset + nbytes] = piece.reshape(-1).view(np.uint8)
            return tuple(checksums)  # of the arrays just verified and copied

        return fill, tuple(checksums)

    def _meta(self, job: str, step: int, rank: int) -> dict:
        return fmt.read_meta(fmt.rank_path(self.directory, job, step, rank))
