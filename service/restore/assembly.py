"""Assembling a restore by regions: read the shards a plan names, verified, and cut them
into one segment laid out as the caller asked.

Each source shard comes whole from the fastest place that holds its rank's copy intact
(this daemon's memory, a peer, the durable tier), checked against its checksum before
any answer uses a byte of it; a copy that fails is recorded and the next place tried.
The pieces are copied box by box (no dtype interpreted) into a fresh segment the
trainer maps (region_cut.py: hashed as they land, in parallel); held copies are checked
in that same pass, and one that fails there throws the answer away: read again, checked
first. For a caller that reads several segments (``RestoreStream``), a region that lies
as one aligned run in a source's segment is answered there instead: a restore onto
fewer processes with the same per-device sharding moves no byte.
"""

import contextlib
import dataclasses

import grpc
import numpy as np

from bubblesnap.protos.checksum import checksum, checksum_with_runs
from bubblesnap.service import answer_segment, checks, phases
from bubblesnap.service.errors import (
    DaemonError,
    DataLoss,
    NotFound,
    ResourceExhausted,
    Unavailable,
    reason,
)
from bubblesnap.service.restore import region_cut
from bubblesnap.service.restore.region_plan import AnswerForm, Asked, RegionPlan
from bubblesnap.service.store import layout as layout_lib
from bubblesnap.service.store import regions
from bubblesnap.service.store.views import Restorable


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one rank's copy of the step can be read: ``places`` in order, each
    ("memory", None), ("peer", ring index) or ("durable", None)."""

    layout: layout_lib.Layout
    places: tuple[tuple[str, int | None], ...]
    group: tuple[int, ...]  # the ranks the copy holds


def asked_layout(asked: list[Asked]) -> layout_lib.Layout:
    """The layout of an assembled answer: the tensors asked, one shard per region asked."""
    return layout_lib.Layout(tuple(
        layout_lib.Tensor(a.name, a.dtype, a.global_shape, tuple(
            layout_lib.Shard(box, regions.volume(box) * checks.ITEMSIZE[a.dtype])
            for box in a.boxes))
        for a in asked))


def exact_answer(found: Restorable, plan: RegionPlan, asked: list[Asked]) -> Restorable:
    """A copy that holds every region asked, box for box, answered as it is: its
    segment, with the slots of the regions asked in request order."""
    slots, checksums = [], []
    for t, tensor_pieces in enumerate(plan.pieces):
        for r, pieces in enumerate(tensor_pieces):
            _, _, offset, nbytes = found.slots[pieces[0].slot]
            slots.append((t, r, offset, nbytes))
            checksums.append(found.checksums[pieces[0].slot])
    return Restorable(found.step, found.segment_path, tuple(slots), tuple(checksums),
                      asked_layout(asked), found.world_size)


class Assembler:
    """Reads the sources of a plan and writes the regions asked into a new segment."""

    def __init__(self, store, transfers=None, durable=None, record=None):
        """``record(job, rank, step, source, detail)`` hears every copy that failed."""
        self._store = store
        self._transfers = transfers
        self._durable = durable
        self._record = record or (lambda *args: None)

    def assemble(self, job: str, step: int, world_size: int, caller: int, plan: RegionPlan,
                 asked: list[Asked], sources: dict[int, Source], answer: AnswerForm = AnswerForm()
                 ) -> tuple[Restorable, str]:
        """The regions asked, and where their bytes came from. ``answer.several_segments``:
        a region that lies as one aligned run in a copy this daemon holds, or in a peer's
        copy pulled whole, is answered as a view of that copy's segment; the others are
        cut into one new segment (hashed only for ``answer.checksums``)."""
        self._store.restore_segments.release(job, caller)  # the rank's earlier answer
        args = (job, step, world_size, caller, plan, asked, sources, answer)
        # Places found corrupt, kept across the attempts below: each recorded once.
        failed: dict = {}
        verify_first: frozenset[int] = frozenset()
        while True:
            try:
                return self._assemble_runs(*args, verify_first, failed)
            except region_cut.SourceCorrupt as err:
                # Held copies failed their checksums while they were cut: read again, those
                # ranks' copies checked first, so each failure is recorded and the next
                # place tried. Ends: only a rank not yet checked first can fail in a cut.
                verify_first |= {rank for rank, _ in err.sources}

    def _assemble_runs(self, job, step, world_size, caller, plan, asked, sources,
                       answer: AnswerForm, verify_first: frozenset[int], failed: dict):
        """As ``assemble``: ``verify_first``'s held copies checked first, ``failed`` skipped."""
        args = (job, step, world_size, caller, plan, asked, sources, answer)
        checks = (verify_first, failed)
        if not answer.several_segments:
            return self._assemble(*args, {}, None, *checks)
        here = {r for r, _ in plan.sources() if sources[r].places[0][0] != "durable"}
        runs = _runs(plan, asked, here)
        try:
            return self._assemble(*args, runs, caller, *checks)
        except ResourceExhausted:
            # Peers' copies kept whole for their runs took the room the answer needs: as
            # without them, the answer's room first and those copies cut.
            return self._assemble(*args, runs, None, *checks)

    def _assemble(self, job: str, step: int, world_size: int, caller: int, plan: RegionPlan,
                  asked: list[Asked], sources: dict[int, Source], answer: AnswerForm,
                  runs: dict, keep_for: int | None, verify_first: frozenset[int], failed: dict
                  ) -> tuple[Restorable, str]:
        """``runs`` (rank -> slot -> region -> (offset, nbytes)) answered where they lie: in
        this daemon's copies, and with ``keep_for`` in peers' copies pulled whole into
        segments served with that rank's answer. Slots of held copies that are only cut
        are verified in the cut's pass over them, but those of ``verify_first``'s ranks;
        ``failed``: places found corrupt ((rank, kind, index) -> why), skipped."""
        needed: dict[int, list[int]] = {}
        for rank, slot in plan.sources():
            needed.setdefault(rank, []).append(slot)
        layout = asked_layout(asked)
        shards, used, views = {}, set(), {}
        unverified: dict = {}  # (rank, slot) -> checksum, checked in the cut

        def read(rank: int, keep: int | None = None) -> None:
            got, place, found = self._read(job, step, rank, needed[rank], sources[rank], held,
                                           runs.get(rank, {}), keep,
                                           None if rank in verify_first else unverified, failed)
            shards.update({(rank, slot): data for slot, data in got.items()})
            views.update(found)
            used.add(place)

        with contextlib.ExitStack() as held:
            # First the copies whose runs may be answered where they lie: this daemon's
            # (they take no room), a peer's pulled whole into a segment kept for the
            # answer. Each source stays pinned or held until the regions are cut out.
            first = [r for r in sorted(needed) if r in runs and (
                keep_for is not None or sources[r].places[0][0] == "memory")]
            for rank in first:
                read(rank, keep_for)
            cut_layout, cut_slots = _cut_layout(layout, views)
            # The answer's room before any other peer's copy is pulled into a scratch
            # segment: one only where the budget has room beside it.
            with self._answer(job, caller, cut_layout.segment_bytes) if cut_slots or not views \
                    else contextlib.nullcontext() as segment:
                for rank in sorted(set(needed) - set(first)):
                    read(rank)
                # (were no region cut, the sources deferred would still be checked)
                cut = self._cut_into(segment, cut_slots, plan, asked, shards, unverified,
                                     answer.checksums) if cut_slots or unverified else {}
        return _answered(step, world_size, layout, segment, views, cut, cut_slots), \
            ", ".join(sorted(used))

    def read_durable(self, job: str, step: int, world_size: int, caller: int, plan: RegionPlan,
                     asked: list[Asked], rank: int, source: Source) -> Restorable:
        """A plan that ``rank``'s written copy serves box for box: its regions read from
        the durable tier straight into the segment handed over, each verified there
        (no intermediate arrays, no copy, one hash)."""
        layout = asked_layout(asked)
        slots = layout.slots()
        written = source.layout.slots()
        self._store.restore_segments.release(job, caller)  # the rank's earlier answer
        try:
            with self._answer(job, caller, layout.segment_bytes) as segment:
                targets = [(*written[pieces[0].slot][:2], segment.view[offset:offset + nbytes])
                           for pieces, (_, _, offset, nbytes) in zip(
                               (region for tensor in plan.pieces for region in tensor), slots,
                               strict=True)]
                checksums = self._durable.read_into(job, step, rank, targets)
        except DataLoss as err:
            self._record(job, rank, step, "durable", str(err))
            raise DataLoss(f"no intact copy of step {step} of rank {rank} of job {job!r}; "
                           f"tried: durable: {err}") from None
        return Restorable(step, segment.path, tuple(slots), checksums, layout, world_size)

    @contextlib.contextmanager
    def _answer(self, job: str, caller: int, nbytes: int):
        """The segment a restore answers with, bytes landing in it inside the block; given
        back if the block fails."""
        with self._store.restore_segments.served(job, caller, nbytes) as segment:
            segment.prefault(self._store.workers)  # fresh pages: faulted in on every core
            yield segment

    def _cut_into(self, segment, slots, plan: RegionPlan, asked: list[Asked], shards: dict,
                  unverified: dict, hashed: bool) -> dict[tuple[int, int], int]:
        """Fills ``slots`` (tensor, region, offset, nbytes) of ``segment`` with those regions
        of ``plan``, the ``unverified`` sources checked in the same pass (SourceCorrupt);
        their checksums by (tensor, region) (0 unless ``hashed``)."""
        filled = {}
        for t, r, offset, nbytes in slots:
            filled[(t, r)] = region_cut.Region(
                segment.view[offset:offset + nbytes], asked[t].boxes[r],
                checks.ITEMSIZE[asked[t].dtype], plan.pieces[t][r])
        with phases.timed("cut"):
            return dict(zip(filled, region_cut.cut(
                list(filled.values()), shards, self._store.workers, unverified,
                self._store.options.checksum_threads, hashed), strict=True))

    def _read(self, job: str, step: int, rank: int, slots: list[int], source: Source,
              held: contextlib.ExitStack, runs, keep_for: int | None, unverified: dict | None,
              failed: dict) -> tuple[dict[int, np.ndarray], str, dict]:
        """The bytes of ``slots`` of ``rank``'s copy, verified, from its first intact place
        (views of memory ``held`` keeps pinned or reserved), the place, and the ``runs``
        (slot -> region -> (offset, nbytes) in it) answered where they lie: region ->
        (segment path, offset, nbytes, checksum). Runs lie where the answer may point:
        in this daemon's copy, or in a peer's pulled whole into a segment served with
        the answer of rank ``keep_for`` (None: pulled into a scratch segment). Slots of a
        held copy with no runs are left to verify, into ``unverified``, where it is given.
        A place in ``failed`` is skipped; one found corrupt is recorded and added."""
        tried, corrupt = [], False
        for kind, index in source.places:
            if (rank, kind, index) in failed:  # by an earlier attempt of this restore
                tried.append(f"{kind}: {failed[(rank, kind, index)]}")
                corrupt = True
                continue
            try:
                got, found = self._read_at(kind, index, job, step, rank, slots, source, held,
                                           runs, keep_for, unverified)
                return got, kind, found
            except DataLoss as err:
                failed[(rank, kind, index)] = str(err)
                self._record(job, rank, step, kind if index is None else f"peer {index}",
                             str(err))
                tried.append(f"{kind}: {err}")
                corrupt = True
            except (DaemonError, grpc.RpcError, OSError) as err:  # a peer gone since the plan
                tried.append(f"{kind}: {reason(err)}")
        what = f"step {step} of rank {rank} of job {job!r}"
        if corrupt:
            raise DataLoss(f"no intact copy of {what}; tried: {'; '.join(tried)}")
        raise Unavailable(f"the copies of {what} could not be read now; tried: "
                          f"{'; '.join(tried) or 'nothing holds it'}. Try again")

    def _read_at(self, kind: str, index, job: str, step: int, rank: int, slots: list[int],
                 source: Source, held: contextlib.ExitStack, runs, keep_for, unverified
                 ) -> tuple[dict[int, np.ndarray], dict]:
        if kind == "memory":
            return self._read_memory(job, step, rank, slots, held, runs, unverified)
        if kind == "peer":
            described = self._transfers.describe(index, job, rank, step)
            if described.layout != source.layout:
                raise NotFound(f"peer {index} holds another layout of step {step} of rank "
                               f"{rank}")
            if _most_of(source.layout, slots):
                keep = keep_for is not None and _most_of_bytes(source.layout, runs)
                try:
                    return self._pull_whole(index, job, step, rank, slots, described, held,
                                            runs if keep else {}, keep_for if keep else None)
                except ResourceExhausted:
                    pass  # the budget has no room for the whole copy: the slots asked alone
            got = self._transfers.read_slots(index, job, rank, step, slots, described)
            return {slot: np.frombuffer(data, np.uint8) for slot, data in got.items()}, {}
        layout_slots = source.layout.slots()
        read = self._durable.read_shards(job, step, rank, [layout_slots[s][:2] for s in slots])
        return dict(zip(slots, read, strict=True)), {}

    def _pull_whole(self, index: int, job: str, step: int, rank: int, slots: list[int],
                    described, held: contextlib.ExitStack, runs, keep_for: int | None
                    ) -> tuple[dict[int, np.ndarray], dict]:
        """Pulls peer ``index``'s whole copy into a segment and answers views of ``slots``
        of it, and ``runs`` answered where they lie (hashed after it landed). Slot by slot
        into buffers of their own, bytes land at a fraction of the rate a whole copy's
        do (parallel streams into pre-faulted pages, hashed as they land). The segment
        is a scratch one freed once the regions are cut, or, with ``keep_for``, served
        with that rank's answer."""
        layout = described.layout
        segments = self._store.restore_segments
        with contextlib.ExitStack() as pulling:  # a pull that fails frees it at once
            if keep_for is None:
                segment = pulling.enter_context(segments.scratch(
                    layout.segment_bytes, f"step {step} of rank {rank} of job {job!r} pulled "
                    "to be cut for a restore"))
            else:  # for a moment unless the restore succeeds: a scratch segment's room
                segment = pulling.enter_context(segments.served(
                    job, keep_for, layout.segment_bytes, scratch=True))
            segment.prefault(self._store.workers)
            self._transfers.pull_into(index, job, rank, step, described, segment.view)
            held.enter_context(pulling.pop_all())
        every = layout.slots()
        got = {slot: segment.view[every[slot][2]:every[slot][2] + every[slot][3]]
               for slot in slots}
        found = [(region, every[slot][2] + offset, nbytes)
                 for slot, regions_in in runs.items() for region, (offset, nbytes)
                 in regions_in.items()]
        with phases.timed("verify"):
            sums = list(self._store.workers.map(
                lambda run: checksum(segment.view[run[1]:run[1] + run[2]]), found))
        return got, {region: (segment.path, offset, nbytes, value)
                     for (region, offset, nbytes), value in zip(found, sums, strict=True)}

    def _read_memory(self, job: str, step: int, rank: int, slots: list[int],
                     held: contextlib.ExitStack, runs, unverified: dict | None
                     ) -> tuple[dict[int, np.ndarray], dict]:
        """Views of the slots of this daemon's copy, hashed first (on the store's workers)
        but for those with no runs when ``unverified`` is given: their checksums go there,
        checked as they are cut. The copy stays pinned while ``held`` is open, so it is
        not recycled under them. ``runs`` are hashed in the same pass, and the copy is
        handed out (never recycled: the client maps it) when there are any, even if a
        slot left to the cut then fails (the answer names another; this one is unlinked
        once freed)."""
        copy = self._store.pin(job, rank, step)
        held.callback(self._store.unpin, copy)
        if runs:  # the client maps it while it is verified
            answer_segment.announce(copy.segment.path, copy.segment.nbytes)
        got = {}
        for slot in slots:
            _, _, offset, nbytes = copy.slots[slot]
            got[slot] = copy.segment.view[offset:offset + nbytes]
        later = set() if unverified is None else {s for s in slots if s not in runs}
        now = {slot: data for slot, data in got.items() if slot not in later}
        computed = []
        if now:
            with phases.timed("verify"):
                computed = list(self._store.workers.map(
                    lambda slot: checksum_with_runs(now[slot],
                                                    list(runs.get(slot, {}).values())), now))
        bad = [slot for slot, (value, _) in zip(now, computed, strict=True)
               if value != copy.checksums[slot]]
        if bad:
            raise DataLoss(f"step {step} of rank {rank}: slot {bad[0]} failed its checksum in "
                           "memory")
        for slot in later:
            unverified[(rank, slot)] = copy.checksums[slot]
        views = {}
        for slot, (_, sums) in zip(now, computed, strict=True):
            for (region, (offset, nbytes)), value in zip(runs.get(slot, {}).items(), sums,
                                                         strict=True):
                views[region] = (copy.segment.path, copy.slots[slot][2] + offset, nbytes, value)
        if views:
            self._store.restore_segments.hand_out(copy)
        return got, views


def _runs(plan: RegionPlan, asked: list[Asked], here: set[int]) -> dict:
    """rank -> slot -> region (tensor, index) -> (offset, nbytes): the regions one piece of
    a copy in ``here`` fills as one run that starts 64-byte aligned (an array may alias
    it, as it may a slot), where in that piece's shard."""
    runs: dict = {}
    for t, tensor_pieces in enumerate(plan.pieces):
        for r, pieces in enumerate(tensor_pieces):
            run = pieces[0].run(checks.ITEMSIZE[asked[t].dtype]) \
                if len(pieces) == 1 and pieces[0].rank in here else None
            if run is not None and run[0] % 64 == 0:
                runs.setdefault(pieces[0].rank, {}).setdefault(pieces[0].slot, {})[(t, r)] = run
    return runs


def _cut_layout(layout: layout_lib.Layout, views: dict) -> tuple[layout_lib.Layout, list]:
    """The regions of ``layout`` not answered as ``views``, packed into one segment: their
    layout and their (tensor, region, offset, nbytes)."""
    tensors, kept = [], []
    for t, tensor in enumerate(layout.tensors):
        regions_cut = [r for r in range(len(tensor.shards)) if (t, r) not in views]
        tensors.append(dataclasses.replace(tensor, shards=tuple(tensor.shards[r]
                                                                for r in regions_cut)))
        kept.extend((t, r) for r in regions_cut)
    cut = layout_lib.Layout(tuple(tensors))
    return cut, [(t, r, offset, nbytes)
                 for (t, r), (_, _, offset, nbytes) in zip(kept, cut.slots(), strict=True)]


def _answered(step: int, world_size: int, layout: layout_lib.Layout, segment, views: dict,
              cut: dict, cut_slots: list) -> Restorable:
    """The answer: each region where it was cut (``segment``) or lies (``views``)."""
    paths = [segment.path] if segment is not None else []
    where = {(t, r): (0, offset, cut[(t, r)]) for t, r, offset, _ in cut_slots}
    for region, (path, offset, _, value) in views.items():
        if path not in paths:
            paths.append(path)
        where[region] = (paths.index(path), offset, value)
    slots, checksums, segments = [], [], []
    for t, r, _, nbytes in layout.slots():
        index, offset, value = where[(t, r)]
        slots.append((t, r, offset, nbytes))
        checksums.append(value)
        segments.append(index)
    return Restorable(step, paths[0], tuple(slots), tuple(checksums), layout, world_size,
                      tuple(paths[1:]), tuple(segments))


def _most_of(layout: layout_lib.Layout, slots: list[int]) -> bool:
    """Whether ``slots`` hold at least half of a copy's bytes."""
    every = layout.slots()
    return 2 * sum(every[s][3] for s in slots) >= layout.segment_bytes


def _most_of_bytes(layout: layout_lib.Layout, runs: dict) -> bool:
    """Whether ``runs`` (slot -> region -> (offset, nbytes)) hold at least half of a copy's
    bytes: a copy pulled whole is kept for them only then (it is held until the rank's
    next restore or commit; kept for a small part, k ranks would each hold all of it)."""
    return 2 * sum(n for regions_in in runs.values() for _, n in regions_in.values()) \
        >= layout.segment_bytes
