"""Pure: whether a CheckpointManager's step left in flight by its trainer is finished by a
daemon now, waited for, or dropped (bubblesnap/shared/save_in_flight.py has the record).

A step is *whole* when every part of it is durable: for every item and every process,
either the daemon that process handed its part to answered that the part is written
(its sidecar), or the process said its own handlers wrote it (its marker). A whole step
is finalized exactly as Orbax would have, once its trainer can no longer do it (its
primary process is gone: its lock is free). Once anyone began finalizing a step, it is
whole by that word alone (the parts' answers are removed while it is finalized).

A step not whole is waited for while its parts may still come: a daemon that began
writing a part (its ``.writing`` answer, which the write keeps touching: a stale one is
a write whose daemon died or froze, and counts as no write) for up to ``parts_wait``
seconds after the trainer went; a part no daemon took and no marker covers only for ``grace`` seconds
after the trainer went (another process of the job may still be handing it over), and
not at all when the caller knows every trainer of the run is gone (a resumed job asks:
``finish_now``). Then the step is dropped: never listed, its folder removed.
"""

import dataclasses

from bubblesnap.shared.save_in_flight import Record


@dataclasses.dataclass(frozen=True)
class Seen:
    """What the step's folders hold now."""

    tmp_exists: bool
    final_exists: bool
    finalizing: bool = False
    #: item -> ranks whose part a daemon wrote (its sidecar), began writing, failed to
    sidecars: dict = dataclasses.field(default_factory=dict)
    writing: dict = dataclasses.field(default_factory=dict)
    failed: dict = dataclasses.field(default_factory=dict)
    #: rank -> the items that process's own handlers wrote, all durable (its marker)
    done: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Verdict:
    action: str  # "finalized" (nothing left to do), "finalize", "wait" or "drop"
    why: str


@dataclasses.dataclass(frozen=True)
class Timing:
    """How long parts are waited for once the trainer is gone (seconds)."""

    grace: float = 5.0
    parts_wait: float = 120.0


def missing_parts(record: Record, seen: Seen) -> list[tuple[str, int]]:
    """(item, rank) of every part not durable yet."""
    return [(item.name, rank) for item in record.items for rank in range(record.world_size)
            if rank not in seen.sidecars.get(item.name, ()) and
            item.name not in seen.done.get(rank, ())]


def judge(record: Record, seen: Seen, gone_for: float | None, finish_now: bool = False,
          timing: Timing = Timing()) -> Verdict:
    """What to do with the step now. ``gone_for``: seconds since its trainer was found
    gone (None: it lives and finalizes the step itself)."""
    if not seen.tmp_exists:
        if seen.final_exists:
            return Verdict("finalized", f"step {record.step} is finalized")
        return Verdict("drop", f"step {record.step}'s folder {record.tmp} is gone")
    if seen.finalizing and gone_for is not None:
        return Verdict("finalize", "its finalizing began: it is whole")
    for item, ranks in sorted(seen.failed.items()):
        if ranks:
            return Verdict("drop", f"the write of process {min(ranks)}'s part of item "
                                   f"{item!r} failed")
    missing = missing_parts(record, seen)
    if gone_for is None:
        return Verdict("wait", "its trainer lives and finalizes it")
    if not missing:
        return Verdict("finalize", "every part is durable")
    started = [(item, rank) for item, rank in missing if rank in seen.writing.get(item, ())]
    never = [part for part in missing if part not in started]
    shown = ", ".join(f"process {rank}'s part of {item!r}" for item, rank in missing[:4])
    if never and (finish_now or gone_for >= timing.grace):
        return Verdict("drop", f"not whole: {shown}{' ...' if len(missing) > 4 else ''} "
                               "never reached a daemon or its handler's end")
    if not never and gone_for >= timing.parts_wait:
        return Verdict("drop", f"not whole {timing.parts_wait:g} s after its trainer went: "
                               f"{shown} still being written")
    return Verdict("wait", f"not whole yet: {shown}")
