"""A CheckpointManager's save in flight, as its trainer leaves it for the daemons: its
layout and record, shared by both ends.

Orbax finalizes a step inside the trainer: once every process's writes are durable, its
primary process merges the items' databases, completes ``_CHECKPOINT_METADATA`` and
renames ``<step>.orbax-checkpoint-tmp`` to ``<step>``. A trainer that dies before that
leaves the step unlisted, though the daemons may hold it whole and write it. So the
primary process, when it starts saving a step the daemons write, leaves in the manager's
directory what finalizing it takes, under :data:`FOLDER`::

    <directory>/.bubblesnap/pending/<step>/
        record.json      the step's folders, its items and how each is finalized, the
                         update of _CHECKPOINT_METADATA Orbax makes at commit (Record)
        trainer.lock     locked (POSIX lockf) by the primary process while it lives and
                         the step is its own to finalize: the kernel lets go of it when
                         the process dies, SIGKILL included
        process_<r>.json process r's items written by their own handlers, done (only a
                         process some of whose parts no daemon writes leaves one)
        finalizing       whoever finalizes the step says so first: from then on the
                         step is known whole (its parts' answers may be gone)

A daemon's answer for a part it wrote stays in the item's folder
(``.bubblesnap/rank_<r>.json``, checkpoint_record.persisted_file) until the step is
finalized, so the daemon finishing a step sees which parts are durable. The folder is
removed once the step is finalized or dropped; nothing of it is inside a step folder.

:class:`Record` is read by a daemon from a file a trainer wrote: never trusted
(:func:`Record.from_json` refuses anything else with ValueError, and every folder it
names lies in the manager's directory).
"""

import dataclasses
import json
import os
import re
import shutil

from bubblesnap.shared.checkpoint_record import STATE_DIR, check_item_name

#: Where a manager's saves in flight are recorded, in its directory.
FOLDER = os.path.join(STATE_DIR, "pending")
RECORD = "record.json"
LOCK = "trainer.lock"
FINALIZING = "finalizing"
FORMAT = "bubblesnap-save-in-flight-1"
#: How an item is finalized: Orbax's PyTree handlers merge the processes' OCDBT
#: databases; handlers whose finalize does nothing need nothing.
FINALIZE_KINDS = ("ocdbt", "none")
_PROCESS = re.compile(r"process_(\d{1,9})\.json")
#: The most a record may say, to bound what a daemon reads.
MAX_RECORD_BYTES = 1 << 20


def folder(directory: str, step: int) -> str:
    """The folder of ``step``'s save in flight in the manager's ``directory``."""
    return os.path.join(directory, FOLDER, str(step))


def steps(directory: str) -> list[int]:
    """The steps of ``directory`` with a save in flight recorded, oldest first."""
    try:
        names = os.listdir(os.path.join(directory, FOLDER))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(name) for name in names if name.isdigit())


def remove(directory: str, step: int) -> None:
    """Removes ``step``'s folder, then the folders above it that are left empty (a
    manager's directory keeps nothing of bubblesnap's once its saves are finalized)."""
    shutil.rmtree(folder(directory, step), ignore_errors=True)
    for empty in (os.path.join(directory, FOLDER), os.path.join(directory, STATE_DIR)):
        try:
            os.rmdir(empty)
        except OSError:
            return  # not empty (another save, steps held in memory only), or gone


def process_file(rank: int) -> str:
    return f"process_{rank}.json"


def processes_done(names) -> list[int]:
    """The processes whose marker is among ``names`` (a pending folder's listing)."""
    return sorted(int(m[1]) for m in map(_PROCESS.fullmatch, names) if m)


@dataclasses.dataclass(frozen=True)
class Item:
    """One item of the step: its temporary and final folders (inside the step's
    temporary folder, where Orbax renames it before the step), how it is finalized, and
    (for an OCDBT item) the options of Orbax's merge."""

    name: str
    tmp: str
    final: str
    finalize: str = "none"
    use_zarr3: bool = False
    validate: bool = False


@dataclasses.dataclass(frozen=True)
class Record:
    """What finalizing ``step`` of the manager in ``directory`` takes (the module's text)."""

    directory: str
    step: int
    world_size: int
    tmp: str
    final: str
    items: tuple[Item, ...]
    metadata: dict  # keys of _CHECKPOINT_METADATA and their values at commit

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **dataclasses.asdict(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, directory: str) -> "Record":
        """The record of a save in flight of the manager in ``directory`` (ValueError if
        it is not one, or names a folder outside that directory)."""
        if len(text) > MAX_RECORD_BYTES:
            raise ValueError(f"the record is over {MAX_RECORD_BYTES} bytes")
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"not a record of a save in flight ({FORMAT})")
        try:
            items = tuple(Item(**item) for item in raw["items"])
            record = cls(directory=raw["directory"], step=raw["step"],
                         world_size=raw["world_size"], tmp=raw["tmp"], final=raw["final"],
                         items=items, metadata=raw["metadata"])
        except (KeyError, TypeError) as err:
            raise ValueError(f"the record lacks or mistypes a field: {err}") from None
        record._check(directory)
        return record

    def _check(self, directory: str) -> None:
        if self.directory != directory:
            raise ValueError(f"the record names another directory: {self.directory[:200]!r}")
        if not (isinstance(self.step, int) and 0 <= self.step < 1 << 62):
            raise ValueError(f"step {self.step!r} is not a step number")
        if not (isinstance(self.world_size, int) and 1 <= self.world_size <= 1 << 20):
            raise ValueError(f"world size {self.world_size!r} is out of range")
        if not isinstance(self.metadata, dict):
            raise ValueError("the record's metadata is no mapping")
        _check_child(self.tmp, directory, "its temporary folder")
        _check_child(self.final, directory, "its folder")
        if not self.items:
            raise ValueError("the record names no item")
        names = set()
        for item in self.items:
            if not isinstance(item.name, str):
                raise ValueError("an item's name is no string")
            check_item_name(item.name)
            names.add(item.name)
            _check_child(item.tmp, self.tmp, f"item {item.name!r}'s temporary folder")
            if item.final != os.path.join(self.tmp, item.name):
                raise ValueError(f"item {item.name!r}'s folder is not in the step's")
            if item.finalize not in FINALIZE_KINDS:
                raise ValueError(f"item {item.name!r}: no finalize {item.finalize!r}")
            if not (isinstance(item.use_zarr3, bool) and isinstance(item.validate, bool)):
                raise ValueError(f"item {item.name!r}: merge options are not booleans")
        if len(names) != len(self.items):
            raise ValueError("the record names an item twice")


def _check_child(path, parent: str, what: str) -> None:
    """``path`` is a folder directly inside ``parent`` (no other folder, no ``..``)."""
    if not isinstance(path, str) or os.path.dirname(path) != parent or \
            os.path.basename(path) in ("", ".", "..") or "\x00" in path:
        raise ValueError(f"{what} is not a folder in {parent[:200]!r}")


@dataclasses.dataclass(frozen=True)
class ProcessDone:
    """Process ``rank``'s parts its own handlers wrote (``items``), all durable."""

    rank: int
    items: tuple[str, ...]

    def to_json(self) -> str:
        return json.dumps({"rank": self.rank, "items": list(self.items)})

    @classmethod
    def from_json(cls, text: str) -> "ProcessDone":
        raw = json.loads(text[:MAX_RECORD_BYTES])
        if not isinstance(raw, dict) or not isinstance(raw.get("rank"), int) or \
                not isinstance(raw.get("items"), list) or \
                not all(isinstance(name, str) for name in raw["items"]):
            raise ValueError("not a process's marker of a save in flight")
        return cls(raw["rank"], tuple(raw["items"]))
