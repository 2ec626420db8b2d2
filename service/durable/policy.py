"""When the durable tier writes a step, when a step's checkpoint is whole, and which
steps it keeps: pure functions."""

import dataclasses

from bubblesnap.service.durable import orbax_layout
from bubblesnap.service.durable.sidecar import WrittenRank
from bubblesnap.service.peers import group_view
from bubblesnap.service.store import regions
from bubblesnap.shared.options import require

#: The zarr compressor of each DurableOptions.compression ("zstd": Orbax's own).
COMPRESSORS = {"none": None, "zstd": {"id": "zstd", "level": 1}}
#: The values of DurableOptions.compression.
COMPRESSIONS = tuple(COMPRESSORS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DurableOptions:
    """When and where snapshots are written to durable storage (flags in brackets).

    Attributes:
      directory: where checkpoints go, a shared filesystem or a bucket mount
        all hosts see (``--durable-dir``). Empty: no durable tier. A
        CheckpointManager whose directory lies inside it has the steps its
        policy keeps written there by the daemon (the Persist call); the
        options below are the daemon's own policy, for bubblesnap's own clients.
      every_steps: write steps that are multiples of this
        (``--durable-every-steps``). Every daemon picks the same steps, so each
        one is whole for the job. 0: off (a CheckpointManager's steps are still
        written as its policy says).
      every_seconds: also write the next committed step once this long has
        passed since the last write (``--durable-every-seconds``). 0: off.
        Hosts decide independently, so a step chosen this way may be whole
        only once every host wrote it.
      keep: whole steps (finalized checkpoints) kept; older steps, finished
        or not, are deleted (``--durable-keep``). Default 2.
      write_batch_bytes: bytes of a step handed to TensorStore before they are
        committed to the database, a chunk (16 MiB) at a time
        (``--durable-write-batch``). TensorStore holds them, and their encoded
        copy, until the commit: this bounds the memory a write takes beside
        what the daemon holds. Each commit writes and fsyncs a few files (one
        rewrites the database's manifest): where a commit is slow (NFS, a
        bucket mounted with gcsfuse) a larger batch means fewer of them, for
        more memory (not measured: the dev VM has only tmpfs and a virtual
        disk). Default 32 MiB: on the dev VM's tmpfs a 1 GB step wrote as fast
        as Orbax's save (benchmarks/durable_write.py), the daemon's anonymous
        memory up by 32-132 MB, against 314-1109 MB and 0.48-0.84x with 256 MiB.
      compression: how each chunk is stored (``--durable-compression``):
        "none", or "zstd" (level 1, Orbax's default). The zarr metadata says
        which, so Orbax and bubblesnap read either. Default "none": trained
        float weights shrink little (a 256 MiB float32 state to 92 % with
        zstd) for the host's CPU, which a daemon shares with the trainer's
        input pipeline; on the dev VM zstd made the write of that state to
        tmpfs 2.9x and its read 2.9x as long, and restores from SeaweedFS S3
        1.3x as long (benchmarks/durable_write.py). Choose "zstd" where
        stored bytes cost more than the cores.
    """

    directory: str = ""
    every_steps: int = 0
    every_seconds: float = 0.0
    keep: int = 2
    write_batch_bytes: int = 32 << 20
    compression: str = "none"

    def __post_init__(self):
        require(self, "every_steps", self.every_steps >= 0, ">= 0", "--durable-every-steps")
        require(self, "every_seconds", self.every_seconds >= 0, ">= 0",
                "--durable-every-seconds")
        require(self, "keep", self.keep >= 1, "at least 1", "--durable-keep")
        require(self, "write_batch_bytes", self.write_batch_bytes >= 1, "at least 1 byte",
                "--durable-write-batch")
        require(self, "compression", self.compression in COMPRESSIONS,
                f"one of {', '.join(COMPRESSIONS)}", "--durable-compression")

    @property
    def enabled(self) -> bool:
        return bool(self.directory)


def should_write(step: int, seconds_since_last: float, options: DurableOptions) -> bool:
    """Whether a newly committed step goes to the durable tier."""
    if options.every_steps and step % options.every_steps == 0:
        return True
    return bool(options.every_seconds) and seconds_since_last >= options.every_seconds


#: After a write fails (the storage refused it or did not answer, past its client's own
#: retries), the tier is not written again for this long, doubled for each failure in a
#: row up to :data:`RETRY_MOST_SECONDS`: a store that is down or refuses the daemon's
#: credentials is asked a few times a minute, not at every committed step.
RETRY_FIRST_SECONDS = 2.0
RETRY_MOST_SECONDS = 60.0


def retry_after(failures_in_a_row: int) -> float:
    """Seconds before the next write, after ``failures_in_a_row`` failed writes."""
    if failures_in_a_row <= 0:
        return 0.0
    return min(RETRY_MOST_SECONDS, RETRY_FIRST_SECONDS * 2 ** (failures_in_a_row - 1))


def step_to_write(waiting: list[int], every_rank_here: bool) -> int:
    """Which of a rank's waiting steps a write that fell behind writes (the others are
    skipped). When every rank of the job is on this daemon no other host has to write
    the same step: the newest, the most progress kept. Else the roundest, the step every
    host behind by any amount also picks. (A CheckpointManager's steps are never
    chosen here: each one its policy saves is written, in order, by Persist.)"""
    return max(waiting) if every_rank_here else group_view.roundest(waiting)


def is_whole(world_size: int, written: dict[int, tuple[int, ...]]) -> bool:
    """Whether every rank of a step is written, itself or through the replica group of a
    written rank (``written``: rank -> the ranks its copy holds)."""
    covered = {member for rank, group in written.items() for member in (rank, *group)}
    return covered >= set(range(world_size))


def incomplete(written: dict[int, WrittenRank]) -> str | None:
    """Why the ranks ``written`` (rank -> its sidecar) do not make a whole checkpoint of
    their step; None when they do.

    Whole: one world size; every rank written, itself or through a written
    rank's replica group; every job-wide array covered by the regions written,
    each element once, with one dtype, shape and chunk grid; no two leaves at
    one place of the tree.
    """
    if not written:
        return "no rank is written"
    sizes = {w.world_size for w in written.values()}
    if len(sizes) != 1:
        return f"ranks were written under different world sizes {sorted(sizes)}"
    world = sizes.pop()
    if not is_whole(world, {rank: w.group for rank, w in written.items()}):
        covered = {m for rank, w in written.items() for m in (rank, *w.group)}
        return f"ranks {sorted(set(range(world)) - covered)[:8]} are not written yet"
    tensors = [t for w in written.values() for t in w.tensors]
    why = orbax_layout.conflict(orbax_layout.leaf(t.key, rank, t.job_wide)
                                for rank, w in written.items() for t in w.tensors)
    if why is not None:
        return why
    arrays: dict[tuple[str, ...], list] = {}
    for t in tensors:
        arrays.setdefault(t.key, []).append(t)
    for key, parts in arrays.items():
        why = _array_incomplete("/".join(key), parts)
        if why is not None:
            return why
    return None


def _array_incomplete(name: str, parts) -> str | None:
    """Why the parts ranks wrote of one array do not make it (None: they do)."""
    first = parts[0]
    if any((t.dtype, t.shape) != (first.dtype, first.shape) for t in parts):
        return f"ranks disagree on the dtype or shape of {name!r}"
    if len({t.chunks for t in parts if t.regions}) > 1:
        return (f"ranks chose different chunk grids for {name!r} (their daemons knew "
                "different layouts, or are of versions that cut chunks differently): their "
                "chunks may overlap")
    boxes = [box for t in parts for box in t.regions]
    gap = regions.missing(first.shape, boxes)
    if gap is not None:
        return f"{regions.describe(name, gap)} is not written"
    if sum(regions.volume(b) for b in boxes) != regions.volume(regions.whole(first.shape)):
        return f"regions of {name!r} overlap: they were written more than once"
    if not boxes:
        return f"no rank wrote {name!r}"  # an empty array: Orbax needs its metadata
    return None


def steps_to_retire(written_here: list[int], whole_steps: list[int], keep: int) -> list[int]:
    """Steps on disk (``written_here``, finished or not) older than the ``keep`` newest
    whole steps.

    The floor is the job's whole steps, not what one daemon wrote: hosts that
    fall behind write different steps, and the step all ranks share could go.
    """
    if not whole_steps:
        return []
    floor = whole_steps[-keep:][0]
    return [s for s in written_here if s < floor]
