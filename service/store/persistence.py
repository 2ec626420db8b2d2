"""The record of a held copy, written beside its segment so a restarted daemon can serve it.

When a copy becomes LOCAL (a trainer's commit, an arrival from a peer or the
durable tier) the store writes ``seg-N.meta`` next to the segment file
``seg-N``: what is needed to serve the copy without the daemon that made it
(job, rank, step, world size, replica group, layout, checksums, whether it is
a replica held for a peer, and the job's registered world size). It goes to
``seg-N.meta.tmp`` first, is fsynced and renamed, so a reader finds a whole
record or none; it is removed when the copy is freed, before the segment is
pooled or unlinked. A segment without a record is unfinished, pooled or an
assembled restore: never adopted (adoption.py).

The format: two lines of JSON. The first is an object whose ``version``
says how to read the rest; every later format keeps that. This is version
1: the first line also holds the copy's fields, the second its layout (a
list of tensors: name, dtype, shape, job_wide, shards of index and nbytes).
A record of a newer version is never read, rewritten or removed here.
"""

import dataclasses
import functools
import json
import os
from types import SimpleNamespace

from bubblesnap.service import checks
from bubblesnap.service.errors import DaemonError
from bubblesnap.service.store import layout as layout_lib
from bubblesnap.service.store.layout import Layout

VERSION = 1
SUFFIX = ".meta"
TEMP_SUFFIX = ".tmp"


class NewerVersion(Exception):
    """A record written by a newer daemon: left as it is."""

    def __init__(self, version: int):
        super().__init__(f"format version {version}; this daemon reads up to {VERSION}")
        self.version = version


class Unreadable(Exception):
    """A record that is not one: cut short, malformed, or describing an impossible copy."""


@dataclasses.dataclass(frozen=True)
class CopyRecord:
    """One LOCAL copy as a restarted daemon needs it."""

    job: str
    job_world_size: int  # the job's world size when the record was written
    rank: int
    step: int
    world_size: int      # the copy's own (the epoch it was taken in)
    group: tuple[int, ...]
    replica: bool        # held for a peer's rank, no trainer registered it here
    replicated: bool     # a peer holds a copy too (or this one came from elsewhere)
    layout: Layout
    checksums: tuple[int, ...]


def path_of(segment_path: str) -> str:
    """Where the record of the copy in ``segment_path`` goes."""
    return segment_path + SUFFIX


def write(segment_path: str, record: CopyRecord) -> None:
    """Writes the record atomically (temp file, fsync, rename); OSError when it cannot."""
    target = path_of(segment_path)
    temp = target + TEMP_SUFFIX
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, encode(record))
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(temp)
        raise
    os.close(fd)
    os.rename(temp, target)


def remove(segment_path: str) -> None:
    """The copy in ``segment_path`` is no longer held: a restart must not bring it back."""
    try:
        os.unlink(path_of(segment_path))
    except FileNotFoundError:
        pass  # never recorded (a staging copy) or removed already


def encode(record: CopyRecord) -> bytes:
    """The two lines of a version-1 record (see the module docstring)."""
    header = {"version": VERSION, "job": record.job, "job_world_size": record.job_world_size,
              "rank": record.rank, "step": record.step, "world_size": record.world_size,
              "group": list(record.group), "replica": record.replica,
              "replicated": record.replicated, "segment_bytes": record.layout.segment_bytes,
              "checksums": list(record.checksums)}
    return (json.dumps(header) + "\n" + _layout_json(record.layout) + "\n").encode()


def read(path: str) -> CopyRecord:
    """The record at ``path``; NewerVersion or Unreadable when it cannot be used."""
    try:
        with open(path, "rb") as f:
            first, _, rest = f.read().decode().partition("\n")
        header = json.loads(first)
        version = header["version"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise Unreadable(f"unreadable record: {err}") from err
    if not isinstance(version, int) or version < 1:
        raise Unreadable(f"unreadable record: version {version!r}")
    if version > VERSION:
        raise NewerVersion(version)
    try:
        return _decode(header, json.loads(rest))
    except (ValueError, KeyError, TypeError, AttributeError, DaemonError) as err:
        raise Unreadable(f"unreadable record: {err}") from err


def _decode(header: dict, tensors: list) -> CopyRecord:
    """A version-1 record, checked as strictly as a Register request."""
    layout = layout_lib.build_layout([_spec(t) for t in tensors])
    job, rank, step = header["job"], header["rank"], header["step"]
    world_size, job_world = header["world_size"], header["job_world_size"]
    if not isinstance(job, str) or not all(
            isinstance(n, int) for n in (rank, step, world_size, job_world)):
        raise ValueError("job, rank, step and world sizes must be a string and integers")
    checks.check_job_name(job)
    checks.check_world(rank, world_size)
    checks.check_world(0, job_world)
    checks.check_step(step)
    group = checks.check_replica_group(rank, world_size, [int(m) for m in header["group"]])
    checksums = tuple(int(c) for c in header["checksums"])
    if len(checksums) != len(layout.slots()) or not all(0 <= c < 1 << 64 for c in checksums):
        raise ValueError(f"{len(checksums)} checksums for {len(layout.slots())} shards")
    if header["segment_bytes"] != layout.segment_bytes:
        raise ValueError(f"segment of {header['segment_bytes']} bytes for a layout of "
                         f"{layout.segment_bytes}")
    return CopyRecord(job, job_world, rank, step, world_size, group, bool(header["replica"]),
                      bool(header["replicated"]), layout, checksums)


@functools.lru_cache(maxsize=64)
def _layout_json(layout: Layout) -> str:
    """A layout's line, encoded once per layout (every copy of a rank shares one)."""
    return json.dumps([{"name": t.name, "dtype": t.dtype, "shape": list(t.global_shape),
                        "job_wide": t.job_wide,
                        "shards": [{"index": [list(box) for box in s.index], "nbytes": s.nbytes}
                                   for s in t.shards]}
                       for t in layout.tensors])


def _spec(tensor: dict) -> SimpleNamespace:
    """A tensor of the layout line in the shape ``build_layout`` reads (as a TensorSpec)."""
    return SimpleNamespace(
        name=tensor["name"], dtype=tensor["dtype"], global_shape=tuple(tensor["shape"]),
        job_wide=bool(tensor["job_wide"]),
        shards=[SimpleNamespace(index=[SimpleNamespace(start=a, stop=b) for a, b in s["index"]],
                                nbytes=s["nbytes"]) for s in tensor["shards"]])
