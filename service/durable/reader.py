"""Reading the durable tier: finalized steps, what each rank wrote, regions read and
verified, and a written rank cut into a layout (for the current restore)."""

import dataclasses
import math

import numpy as np

from bubblesnap.protos.checksum import checksum
from bubblesnap.service import phases
from bubblesnap.service.durable import checkpoint, orbax_layout
from bubblesnap.service.durable import format as fmt
from bubblesnap.service.durable.sidecar import WrittenRank, WrittenTensor
from bubblesnap.service.errors import DaemonError, DataLoss, FailedPrecondition, NotFound
from bubblesnap.service.store import layout as layout_lib
from bubblesnap.service.store import regions


@dataclasses.dataclass(frozen=True)
class RankCopy:
    """What a finalized step holds of one written rank: its ``layout`` (a shard per
    region it wrote), its replica group and the checksum of each slot (in
    ``layout.slots()`` order)."""

    rank: int
    world_size: int
    layout: layout_lib.Layout
    group: tuple[int, ...]
    checksums: tuple[int, ...]


class DurableReader:
    """Finds and reads what the daemons of a job wrote under ``directory``."""

    def __init__(self, directory: str):
        self.directory = directory

    def steps(self, job: str, world_size: int | None = None) -> list[int]:
        """Finalized steps of ``job``, oldest first; with ``world_size``, only those
        written under it (a rank's copy means nothing under another)."""
        found = []
        for step in fmt.step_numbers(self.directory, job):
            if world_size is None:
                if fmt.is_finalized(self._step_dir(job, step)):
                    found.append(step)
            elif self._marker_world(job, step) == world_size:
                found.append(step)
        return found

    def world_size(self, job: str, step: int | None = None) -> int:
        """The world size of ``step`` (default: the newest finalized step); 0: none."""
        candidates = [step] if step is not None else \
            reversed(fmt.step_numbers(self.directory, job))
        for candidate in candidates:
            size = self._marker_world(job, candidate)
            if size:
                return size
        return 0

    def step_layouts(self, job: str, step: int) -> dict[int, RankCopy]:
        """Every rank written in finalized ``step``: its layout, group and checksums."""
        self._finalized(job, step)
        return {rank: RankCopy(rank, w.world_size, w.layout(), w.group, w.slot_checksums())
                for rank, w in self.sidecars(job, step).items()}

    def read_shard(self, job: str, step: int, rank: int, tensor_index: int,
                   shard_index: int) -> np.ndarray:
        """The bytes (C order, uint8) of one region ``rank`` wrote, read from the step's
        checkpoint and verified against its checksum (DataLoss if not)."""
        step_dir = self._finalized(job, step)
        tensor = self._tensor(self._sidecar(job, step, rank), tensor_index)
        if not 0 <= shard_index < len(tensor.regions):
            raise NotFound(f"rank {rank} wrote {len(tensor.regions)} regions of "
                           f"{tensor.name!r} in step {step}; there is no region {shard_index}")
        array = self._open(step_dir, tensor)
        return self._verified(step_dir, array, tensor, shard_index).reshape(-1).view(np.uint8)

    def read_into(self, job: str, step: int, rank: int, targets) -> tuple[int, ...]:
        """Reads regions ``rank`` wrote straight into ``targets`` ((tensor index, region
        index, uint8 view of exactly its bytes): slots of the segment to be served), all
        at once (TensorStore overlaps the reads), then verifies each where it landed;
        their checksums. DataLoss when one cannot be read or does not match."""
        step_dir = self._finalized(job, step)
        written = self._sidecar(job, step, rank)
        tensors = [self._tensor(written, t) for t, _, _ in targets]
        for tensor, (_, index, _) in zip(tensors, targets, strict=True):
            if not 0 <= index < len(tensor.regions):
                raise NotFound(f"rank {rank} wrote {len(tensor.regions)} regions of "
                               f"{tensor.name!r} in step {step}; there is no region {index}")
        with phases.timed("open"):
            # each array opened once for all its regions, every open at once; a context
            # per read: a rewritten step must not be read from a stale cache
            context = checkpoint.context()
            try:
                started = {key: checkpoint.start_open(
                    step_dir, orbax_layout.param_name(key), context)
                    for key in dict.fromkeys(t.key for t in tensors)}
                arrays = {key: future.result() for key, future in started.items()}
            except Exception as err:
                raise DataLoss(f"{step_dir}: an array of rank {rank} cannot be opened: "
                               f"{err}") from err
        with phases.timed("read"):
            try:
                reads = [checkpoint.read_box_into(
                    arrays[tensor.key], tensor.regions[index],
                    out.view(fmt.numpy_dtype(tensor.dtype)).reshape(
                        [b - a for a, b in tensor.regions[index]]))
                    for tensor, (_, index, out) in zip(tensors, targets, strict=True)]
                for read in reads:
                    read.result()
            except Exception as err:  # TensorStore raises many types for damaged files
                raise DataLoss(f"{step_dir}: a region of rank {rank} cannot be read: "
                               f"{err}") from err
        with phases.timed("verify"):
            for tensor, (_, index, out) in zip(tensors, targets, strict=True):
                if checksum(out) != tensor.checksums[index]:
                    raise DataLoss(f"{step_dir}: region "
                                   f"{regions.describe(tensor.name, tensor.regions[index])} "
                                   "does not match its checksum")
        return tuple(tensor.checksums[index] for tensor, (_, index, _) in
                     zip(tensors, targets, strict=True))

    def sidecars(self, job: str, step: int) -> dict[int, WrittenRank]:
        """The finished writes of ``step`` (finalized or not), by rank; an unreadable
        sidecar counts as not written."""
        step_dir = self._step_dir(job, step)
        found = {}
        for rank in fmt.written_ranks(step_dir):
            try:
                found[rank] = fmt.read_sidecar(step_dir, rank)
            except DaemonError:
                continue
        return found

    def written_slots(self, job: str, rank: int, step: int) -> list[int] | None:
        """Slot checksums of the copy written for (job, rank, step); None if none is readable."""
        try:
            return list(self._sidecar(job, step, rank).slot_checksums())
        except DaemonError:
            return None

    def replica_group(self, job: str, rank: int, step: int) -> tuple[int, ...]:
        """The replica group a written rank declared (the ranks its copy holds)."""
        return self._sidecar(job, step, rank).group or (rank,)

    def whole_layout(self, job: str, rank: int, step: int) -> layout_lib.Layout:
        """The rank's layout as written, with each of its own tensors whole (one shard);
        a job-wide tensor keeps the regions the rank wrote of it."""
        written = self._sidecar(job, step, rank).layout()
        return layout_lib.Layout(tuple(
            t if t.job_wide else dataclasses.replace(t, shards=(layout_lib.Shard(
                regions.whole(t.global_shape),
                math.prod(t.global_shape) * layout_lib.ITEMSIZE[t.dtype]),))
            for t in written.tensors))

    def load(self, job: str, rank: int, step: int, layout: layout_lib.Layout):
        """Reads a written rank of a finalized step, cut into ``layout``'s shards (its
        registered layout, or :meth:`whole_layout`).

        Returns ``(fill, checksums)`` for ``SnapshotStore.install``. Every region
        read is verified against its checksum first; DataLoss when one does not
        match or the checkpoint cannot be read.
        """
        step_dir = self._finalized(job, step)
        written = self.sidecars(job, step)
        if rank not in written:
            raise NotFound(f"step {step} of job {job!r} holds no copy of rank {rank}")
        mine = {t.name: t for t in written[rank].tensors}
        registered = {t.name: (t.dtype, t.global_shape) for t in layout.tensors}
        differ = sorted(n for n in set(mine) | set(registered)
                        if registered.get(n) != ((mine[n].dtype, mine[n].shape)
                                                 if n in mine else None))
        if differ:
            raise FailedPrecondition(
                f"{step_dir} does not hold the registered state of rank {rank}: tensors "
                f"{differ[:4]} differ in name, dtype or shape")
        pieces, checksums, opened = [], [], {}
        for t_index, s_index, offset, nbytes in layout.slots():
            tensor = mine[layout.tensors[t_index].name]
            if tensor.key not in opened:
                opened[tensor.key] = self._open(step_dir, tensor)
            sources = [t for w in written.values() for t in w.tensors if t.key == tensor.key] \
                if tensor.job_wide else [tensor]
            piece = self._assemble(step_dir, opened[tensor.key], sources,
                                   layout.tensors[t_index].shards[s_index].index)
            pieces.append((offset, nbytes, piece.reshape(-1).view(np.uint8)))
            with phases.timed("verify"):
                checksums.append(checksum(pieces[-1][2]))

        def fill(view, slots):
            with phases.timed("copy"):
                for offset, nbytes, piece in pieces:
                    view[offset:offset + nbytes] = piece
            return tuple(checksums)  # of the regions just verified and copied

        return fill, tuple(checksums)

    def _assemble(self, step_dir: str, array, sources: list[WrittenTensor],
                  box) -> np.ndarray:
        """``box`` of an array from the verified regions that meet it."""
        tensor = sources[0]
        for source in sources:  # the common case: the box is a region as written
            if box in source.regions:
                return self._verified(step_dir, array, source, source.regions.index(box))
        out = np.empty(tuple(b - a for a, b in box), fmt.numpy_dtype(tensor.dtype))
        found = []
        for source in sources:
            for index, region in enumerate(source.regions):
                common = regions.intersect(region, box)
                if common is None:
                    continue
                data = self._verified(step_dir, array, source, index)
                out[regions.relative(common, box)] = data[regions.relative(common, region)]
                found.append(common)
        gap = regions.missing(out.shape, [tuple((a - s, b - s) for (a, b), (s, _) in
                                                zip(c, box, strict=True)) for c in found])
        if gap is not None:
            raise DataLoss(f"{step_dir}: no region written covers "
                           f"{regions.describe(tensor.name, box)}")
        return out

    def _verified(self, step_dir: str, array, tensor: WrittenTensor, index: int) -> np.ndarray:
        try:
            with phases.timed("read"):
                data = checkpoint.read_box(array, tensor.regions[index])
        except Exception as err:  # TensorStore raises many types for damaged files
            raise DataLoss(f"{step_dir}: region {index} of {tensor.name!r} cannot be read: "
                           f"{err}") from err
        with phases.timed("verify"):
            computed = checksum(data.reshape(-1).view(np.uint8))
        if computed != tensor.checksums[index]:
            raise DataLoss(f"{step_dir}: region "
                           f"{regions.describe(tensor.name, tensor.regions[index])} does not "
                           "match its checksum")
        return data

    def _open(self, step_dir: str, tensor: WrittenTensor):
        try:
            # A context per read: a rewritten step must not be read from a stale cache.
            with phases.timed("open"):
                return checkpoint.open_array(step_dir, orbax_layout.param_name(tensor.key),
                                             checkpoint.context())
        except Exception as err:
            raise DataLoss(f"{step_dir}: array {tensor.name!r} cannot be opened: {err}") from err

    def _finalized(self, job: str, step: int) -> str:
        step_dir = self._step_dir(job, step)
        if not fmt.is_finalized(step_dir):
            raise NotFound(f"step {step} of job {job!r} is not a finalized durable checkpoint")
        return step_dir

    def _sidecar(self, job: str, step: int, rank: int) -> WrittenRank:
        return fmt.read_sidecar(self._step_dir(job, step), rank)

    @staticmethod
    def _tensor(written: WrittenRank, index: int) -> WrittenTensor:
        if not 0 <= index < len(written.tensors):
            raise NotFound(f"rank {written.rank} wrote {len(written.tensors)} tensors in step "
                           f"{written.step}; there is no tensor {index}")
        return written.tensors[index]

    def _marker_world(self, job: str, step: int) -> int:
        try:
            return int(fmt.read_json(fmt.marker_path(self._step_dir(job, step)))["world_size"])
        except (DaemonError, KeyError, TypeError, ValueError):
            return 0

    def _step_dir(self, job: str, step: int) -> str:
        return fmt.step_path(self.directory, job, step)
