"""Reading the durable tier: finalized steps, what each rank wrote, regions read and
verified, and a written rank cut into a layout (for the current restore)."""

import contextlib
import contextvars
import dataclasses
import math

import numpy as np

from bubblesnap.protos.checksum import checksum
from bubblesnap.service import checks, phases, progress
from bubblesnap.service.durable import checkpoint, orbax_layout, storage
from bubblesnap.service.durable import format as fmt
from bubblesnap.service.durable.listing import Listings
from bubblesnap.service.durable.sidecar import WrittenRank, WrittenTensor
from bubblesnap.service.errors import (
    DaemonError,
    DataLoss,
    FailedPrecondition,
    NotFound,
    Unavailable,
)
from bubblesnap.service.store import layout as layout_lib
from bubblesnap.service.store import regions

#: A region is read in pieces of whole chunks of at most this much (one chunk row at
#: least): TensorStore would otherwise hold buffers for all of one shard of many GB at
#: once, whatever ``read_bytes_in_flight`` says. One chunk: 64 MB pieces with 64 MB in
#: flight read a region or two at a time (795 against 601 ms).
READ_PIECE_BYTES = checkpoint.CHUNK_BYTES
#: What one restore learned of the tier's files (DurableReader.one_view), by question.
_VIEW: contextvars.ContextVar[dict | None] = contextvars.ContextVar("durable_view", default=None)


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
        self._listings = Listings(directory)

    @contextlib.contextmanager
    def one_view(self):
        """Inside the block (one restore, on its thread) each step's folder, marker and
        sidecars are looked up once and the answers kept: a restore by regions asked for
        the same ones up to five times (on an object store, ~15 requests for a step of
        one rank; each a round trip to the store). What fails is asked again."""
        token = _VIEW.set({})
        try:
            yield
        finally:
            _VIEW.reset(token)

    def steps(self, job: str, world_size: int | None = None) -> list[int]:
        """Finalized steps of ``job``, oldest first; with ``world_size``, only those
        written under it (a rank's copy means nothing under another)."""
        found = self._listed(job)
        if world_size is None:
            return sorted(found)
        return [step for step, path in sorted(found.items())
                if _viewed(("world", path), lambda p=path: _world_of(p)) == world_size]

    def world_size(self, job: str, step: int | None = None) -> int:
        """The world size of ``step`` (default: the newest finalized step); 0: none."""
        candidates = [step] if step is not None else reversed(sorted(self._listed(job)))
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

    def read_shards(self, job: str, step: int, rank: int,
                    shards: list[tuple[int, int]]) -> list[np.ndarray]:
        """The bytes (C order, uint8) of the regions ``rank`` wrote, each named by
        (tensor index, region index), read from the step's checkpoint together (every
        array opened once, the reads in flight on TensorStore's threads, up to
        the storage's ``read_bytes_in_flight``) and each verified against its checksum (DataLoss if
        not)."""
        step_dir = self._finalized(job, step)
        wanted = self._wanted(self._sidecar(job, step, rank), shards)
        arrays = self._open_all(step_dir, [t for t, _ in wanted])
        return [data.reshape(-1).view(np.uint8)
                for data in self._read_all(step_dir, arrays, wanted)]

    def read_into(self, job: str, step: int, rank: int, targets) -> tuple[int, ...]:
        """Reads regions ``rank`` wrote straight into ``targets`` ((tensor index, region
        index, uint8 view of exactly its bytes): slots of the segment to be served),
        together as ``read_shards`` does, and verifies each where it landed; their
        checksums. DataLoss when one cannot be read or does not match."""
        step_dir = self._finalized(job, step)
        wanted = self._wanted(self._sidecar(job, step, rank), [t[:2] for t in targets])
        arrays = self._open_all(step_dir, [t for t, _ in wanted])
        self._read_all(step_dir, arrays, wanted, into=[out for _, _, out in targets])
        return tuple(tensor.checksums[index] for tensor, index in wanted)

    def _wanted(self, written: WrittenRank,
                shards) -> list[tuple[WrittenTensor, int]]:
        """(tensor, region index) of each (tensor index, region index) ``written`` has;
        NotFound naming one it does not."""
        wanted = []
        for tensor_index, shard_index in shards:
            tensor = self._tensor(written, tensor_index)
            if not 0 <= shard_index < len(tensor.regions):
                raise NotFound(f"rank {written.rank} wrote {len(tensor.regions)} regions of "
                               f"{tensor.name!r} in step {written.step}; there is no region "
                               f"{shard_index}")
            wanted.append((tensor, shard_index))
        return wanted

    def sidecars(self, job: str, step: int) -> dict[int, WrittenRank]:
        """The finished writes of ``step`` (finalized or not), by rank; an unreadable
        sidecar counts as not written."""
        step_dir = self._step_dir(job, step)
        found = {}
        for rank in _viewed(("ranks", step_dir), lambda: fmt.written_ranks(step_dir)):
            try:
                found[rank] = _read_sidecar(step_dir, rank)
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
                math.prod(t.global_shape) * checks.ITEMSIZE[t.dtype]),))
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
        # A slot that is a region as written (the usual case) is read in ``fill``
        # straight into the segment and verified there against the checksum it was
        # written with; one cut from other regions is read and assembled now.
        direct, cut, checksums = [], [], []
        for slot, (t_index, s_index, offset, nbytes) in enumerate(layout.slots()):
            tensor = mine[layout.tensors[t_index].name]
            tensors = [t for w in written.values() for t in w.tensors
                       if t.key == tensor.key] if tensor.job_wide else [tensor]
            box = layout.tensors[t_index].shards[s_index].index
            exact = next((t for t in tensors if box in t.regions), None)
            if exact is not None:
                direct.append((offset, nbytes, exact, exact.regions.index(box)))
                checksums.append(exact.checksums[direct[-1][3]])
            else:
                cut.append((slot, offset, nbytes, tensors, box))
                checksums.append(None)  # of the piece, once assembled below
        arrays = self._open_all(step_dir, [d[2] for d in direct] + [c[3][0] for c in cut])
        read = self._regions_meeting(step_dir, arrays, [c[3] for c in cut],
                                     [c[4] for c in cut])
        pieces = []
        for slot, offset, nbytes, tensors, box in cut:
            pieces.append((offset, nbytes, self._assemble(step_dir, read, tensors, box)
                           .reshape(-1).view(np.uint8)))
            checksums[slot] = checksum(pieces[-1][2])

        def fill(view, slots):
            self._read_all(step_dir, arrays, [(t, i) for _, _, t, i in direct],
                           into=[view[o:o + n] for o, n, _, _ in direct])
            with phases.timed("copy"):
                for offset, nbytes, piece in pieces:
                    view[offset:offset + nbytes] = piece
            return tuple(checksums)  # every slot's bytes verified, read in or copied

        return fill, tuple(checksums)

    def _regions_meeting(self, step_dir: str, arrays: dict, sources, boxes) -> dict:
        """Every written region that meets a box, read together and verified: by (tensor
        key, region). Ranks that wrote the same region of a job-wide array wrote the
        same bytes: it is read once."""
        wanted = {(t.key, region): (t, index)
                  for tensors, box in zip(sources, boxes, strict=True) for t in tensors
                  for index, region in enumerate(t.regions)
                  if regions.intersect(region, box) is not None}
        got = self._read_all(step_dir, arrays, list(wanted.values()))
        return dict(zip(wanted, got, strict=True))

    def _assemble(self, step_dir: str, read: dict, sources: list[WrittenTensor],
                  box) -> np.ndarray:
        """``box`` of an array, cut from the verified regions that meet it (in ``read``)."""
        tensor = sources[0]
        out = np.empty(tuple(b - a for a, b in box), fmt.numpy_dtype(tensor.dtype))
        found = []
        for source in sources:
            for region in source.regions:
                common = regions.intersect(region, box)
                if common is None:
                    continue
                data = read[(source.key, region)]
                out[regions.relative(common, box)] = data[regions.relative(common, region)]
                found.append(common)
        gap = regions.missing(out.shape, [tuple((a - s, b - s) for (a, b), (s, _) in
                                                zip(c, box, strict=True)) for c in found])
        if gap is not None:
            raise DataLoss(f"{step_dir}: no region written covers "
                           f"{regions.describe(tensor.name, box)}")
        return out

    def _read_all(self, step_dir: str, arrays: dict, wanted: list[tuple[WrittenTensor, int]],
                  into: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """The regions (tensor, region index) of opened ``arrays``, in order, each verified
        against its checksum once it is whole; with ``into``, each read straight into its
        uint8 view there (returned). A region is read in pieces of whole chunks (at most
        ``READ_PIECE_BYTES``, a chunk row at least), on TensorStore's threads, up to
        the storage's ``read_bytes_in_flight`` of pieces at a time."""
        dtypes = [fmt.numpy_dtype(t.dtype) for t, _ in wanted]
        shapes = [tuple(b - a for a, b in t.regions[i]) for t, i in wanted]
        outs = into or [np.empty(shape, dtype) for shape, dtype in zip(shapes, dtypes,
                                                                         strict=True)]
        progress.expect(sum(out.nbytes for out in outs))
        done = progress.reporter()
        pieces = []  # (region's position, piece box, its bytes in the region's)
        for at, (tensor, index) in enumerate(wanted):
            box = tensor.regions[index]
            elements = outs[at].reshape(-1).view(np.uint8).view(dtypes[at]).reshape(shapes[at])
            for piece in orbax_layout.row_pieces(box, tensor.chunks or shapes[at],
                                                 dtypes[at].itemsize, READ_PIECE_BYTES):
                rows = elements[orbax_layout.rows_of(box, piece)]
                pieces.append((at, piece, rows.reshape(-1).view(np.uint8)))
        futures, in_flight = [], 0
        most = storage.at(step_dir).read_bytes_in_flight
        out = []
        for number, (at, _, target) in enumerate(pieces):
            while len(futures) < len(pieces) and (
                    len(futures) == number or
                    in_flight + pieces[len(futures)][2].nbytes <= most):
                first_at, box, bytes_view = pieces[len(futures)]
                futures.append(checkpoint.read_box(arrays[wanted[first_at][0].key], box,
                                                   bytes_view))
                in_flight += bytes_view.nbytes
            tensor, index = wanted[at]
            try:
                with phases.timed("read"):
                    futures[number].result()
                done(target.nbytes)
            except Exception as err:  # TensorStore raises many types for damaged files
                _settle(futures[number + 1:])
                _unless_unanswered(step_dir, err)
                raise DataLoss(f"{step_dir}: region {index} of {tensor.name!r} cannot be "
                               f"read: {err}") from err
            in_flight -= target.nbytes
            futures[number] = None  # its buffers go with it
            if number + 1 < len(pieces) and pieces[number + 1][0] == at:
                continue  # the region is not whole yet
            with phases.timed("verify"):
                computed = checksum(outs[at].reshape(-1).view(np.uint8))
            if computed != tensor.checksums[index]:
                _settle(futures[number + 1:])
                raise DataLoss(f"{step_dir}: region "
                               f"{regions.describe(tensor.name, tensor.regions[index])} does "
                               "not match its checksum")
            out.append(outs[at])
        return out

    def _open_all(self, step_dir: str, tensors: list[WrittenTensor]) -> dict:
        """Each array of ``tensors`` opened once, the opens in flight together; by key.
        One context per call: a rewritten step must not be read from a stale cache."""
        ctx = checkpoint.context()
        futures = {t.key: (t, checkpoint.open_array(step_dir, t.param, ctx))
                   for t in tensors}
        opened = {}
        for key, (tensor, future) in futures.items():
            try:
                with phases.timed("open"):
                    opened[key] = future.result()
            except Exception as err:
                _unless_unanswered(step_dir, err)
                raise DataLoss(f"{step_dir}: array {tensor.name!r} cannot be opened: "
                               f"{err}") from err
        return opened

    def _listed(self, job: str) -> dict[int, str]:
        """The finalized steps; none while the storage does not answer (listing.py)."""
        return self._listings.finalized(job)

    def _finalized(self, job: str, step: int) -> str:
        step_dir = self._step_dir(job, step)
        if not _viewed(("finalized", step_dir), lambda: fmt.is_finalized(step_dir)):
            raise NotFound(f"step {step} of job {job!r} is not a finalized durable checkpoint")
        return step_dir

    def _sidecar(self, job: str, step: int, rank: int) -> WrittenRank:
        return _read_sidecar(self._step_dir(job, step), rank)

    @staticmethod
    def _tensor(written: WrittenRank, index: int) -> WrittenTensor:
        if not 0 <= index < len(written.tensors):
            raise NotFound(f"rank {written.rank} wrote {len(written.tensors)} tensors in step "
                           f"{written.step}; there is no tensor {index}")
        return written.tensors[index]

    def _marker_world(self, job: str, step: int) -> int:
        step_dir = self._step_dir(job, step)
        return _viewed(("world", step_dir), lambda: _world_of(step_dir))

    def _step_dir(self, job: str, step: int) -> str:
        return _viewed(("folder", job, step), lambda: fmt.step_path(self.directory, job, step))


def _read_sidecar(step_dir: str, rank: int) -> WrittenRank:
    return _viewed(("sidecar", step_dir, rank), lambda: fmt.read_sidecar(step_dir, rank))


def _viewed(question: tuple, look):
    """``look()``, or inside ``one_view`` the answer it gave there before."""
    view = _VIEW.get()
    if view is None:
        return look()
    if question not in view:
        view[question] = look()
    return view[question]


def _world_of(step_dir: str) -> int:
    """The world size a finalized step's marker names (0: none readable)."""
    try:
        return int(fmt.read_json(fmt.marker_path(step_dir))["world_size"])
    except (DaemonError, KeyError, TypeError, ValueError):
        return 0


#: TensorStore's words for a store that did not answer (not a damaged file).
_UNANSWERED = ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def _unless_unanswered(step_dir: str, err: Exception) -> None:
    """Unavailable when ``err`` is an object store's silence, not damage: the copy is
    not corrupt, the restore may be asked again."""
    if not storage.at(step_dir).renames and str(err).startswith(_UNANSWERED):
        raise Unavailable(f"{step_dir}: the store did not answer: {str(err)[:300]}") from err


def _settle(futures) -> None:
    """Waits out reads still in flight, their errors ignored: the caller gives back the
    memory they land in as soon as the read fails."""
    for future in futures:
        with contextlib.suppress(Exception):  # a read given up already
            future.result()
