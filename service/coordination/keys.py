"""Pure: the etcd key layout of a daemon group, and the values stored under it.

Everything of one group lives under its prefix (``--coordination-prefix``):

``slots/<index>``
    the daemon holding ring position ``index``: its peer address (under its
    lease, so it vanishes when the daemon stops renewing it).
``names/<name>``
    the position a daemon of that name held last (no lease): a daemon that
    restarts on its host takes its old place, and the copies it adopts keep
    their ring index.
``holdings/<job>/<rank>/<step>/<index>``
    daemon ``index`` holds a committed copy of (rank, step) (under its
    lease: a dead daemon's copies leave the view with it). Keyed by rank
    first, so a daemon reads the holders of the ranks it holds in one range
    each, whatever the group's size.
``layouts/<job>/<rank>``
    the layout a rank registered with (its daemon's lease).
``summary/<job>``
    the job's committed and restorable steps, written by the group's
    aggregator (the live daemon with the lowest index) from every holding.
``ready/<index>``
    the holder of position ``index`` (its address, under its lease) has
    published what it held when it took the position: a restore waits for
    every position held to be marked so before it picks a step.

Numbers in keys are zero-padded so that etcd's byte order is numeric order. A job
is one key part: a job named by a folder (a CheckpointManager's item, "/a/b/item")
has its "/" and "%" escaped (``%2F``, ``%25``), other names are as they are.
"""

import dataclasses
import json
import logging

from google.protobuf.message import DecodeError

from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.service.log_once import warn_once
from bubblesnap.service.peers.group_view import Holding

log = logging.getLogger("bubblesnap.daemon")

_WIDTH = 12  # digits of a padded number: steps up to 10**12


def _num(value: int) -> str:
    return f"{value:0{_WIDTH}d}"


def _part(job: str) -> str:
    """``job`` as one key part (a folder's "/" and "%" escaped)."""
    return job.replace("%", "%25").replace("/", "%2F")


def _job(part: str) -> str:
    return part.replace("%2F", "/").replace("%25", "%")


def prefix_end(prefix: str) -> str:
    """The end of the key range that holds every key starting with ``prefix``."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


@dataclasses.dataclass(frozen=True)
class Keys:
    """The keys of one group, under ``root`` (ends without a slash)."""

    root: str

    def slots(self) -> str:
        return f"{self.root}/slots/"

    def slot(self, index: int) -> str:
        return f"{self.slots()}{_num(index)}"

    def name(self, name: str) -> str:
        return f"{self.root}/names/{name}"

    def holdings(self, job: str = "") -> str:
        return f"{self.root}/holdings/" + (f"{_part(job)}/" if job else "")

    def rank_holdings(self, job: str, rank: int) -> str:
        return f"{self.holdings(job)}{_num(rank)}/"

    def holding(self, job: str, rank: int, step: int, index: int) -> str:
        return f"{self.rank_holdings(job, rank)}{_num(step)}/{_num(index)}"

    def layouts(self, job: str = "") -> str:
        return f"{self.root}/layouts/" + (f"{_part(job)}/" if job else "")

    def layout(self, job: str, rank: int) -> str:
        return f"{self.layouts(job)}{_num(rank)}"

    def summaries(self) -> str:
        return f"{self.root}/summary/"

    def summary(self, job: str) -> str:
        return f"{self.summaries()}{_part(job)}"

    def readies(self) -> str:
        return f"{self.root}/ready/"

    def ready(self, index: int) -> str:
        return f"{self.readies()}{_num(index)}"

    def job_of(self, key: str, prefix: str) -> str:
        """The job a key under ``prefix`` (holdings/, layouts/, summary/) belongs to."""
        return _job(key[len(prefix):].split("/", 1)[0])


def holding_value(h) -> bytes:
    """What a holding key stores: the copy as the Holdings RPC describes it."""
    return ppb.HeldCopy(rank=h.rank, step=h.step, role=ppb.REPLICA if h.replica else ppb.PRIMARY,
                        world_size=h.world_size, replica_group=h.group).SerializeToString()


def parse_holding(key: str, value: bytes) -> Holding:
    """The Holding a key and its value say (the holder's index is the key's last part);
    ValueError for a key or value no daemon wrote."""
    try:
        copy = ppb.HeldCopy.FromString(value)
    except DecodeError as err:
        raise ValueError(f"{key}: not a HeldCopy") from err
    return Holding(int(key.rsplit("/", 1)[1]), copy.rank, copy.step, copy.role == ppb.REPLICA,
                   copy.world_size, tuple(copy.replica_group))


def parse_holdings(items) -> list[Holding]:
    """The Holdings of ``(key, value)`` pairs; a pair no daemon wrote (someone else's
    key under the prefix) is left out and logged, so it cannot stop the group."""
    found = []
    for key, value in items:
        try:
            found.append(parse_holding(key, value))
        except ValueError as err:
            warn_once(log, key, "ignoring etcd key %s (said once per key)", err)
    return found


def summary_value(committed, restorable) -> bytes:
    return json.dumps({"committed": sorted(committed),
                       "restorable": sorted(restorable)}).encode()


def parse_summary(value: bytes) -> tuple[list[int], list[int]] | None:
    """(committed steps, restorable steps) of a summary key's value; None for a value
    no aggregator wrote."""
    try:
        found = json.loads(value)
        return [int(s) for s in found["committed"]], [int(s) for s in found["restorable"]]
    except (ValueError, KeyError, TypeError):
        warn_once(log, f"summary {value[:80]!r}", "ignoring a malformed summary in etcd: "
                  "%r (said once per value)", value[:80])
        return None


def parse_slot(keys: "Keys", key: str) -> int | None:
    """The ring index of a slots/ key; None for one no daemon wrote."""
    tail = key[len(keys.slots()):]
    return int(tail) if tail.isdigit() else None


def parse_positions(prefix: str, items: dict[str, bytes]) -> dict[int, str]:
    """Ring index -> address, of the keys under ``prefix`` (slots/ or ready/); keys no
    daemon wrote are left out."""
    found = {}
    for key, value in items.items():
        tail = key[len(prefix):]
        if key.startswith(prefix) and tail.isdigit():
            found[int(tail)] = value.decode(errors="replace")
    return found


def claim_order(size: int, preferred: int, explicit: bool, held: dict[int, str],
                address: str) -> list[int]:
    """The ring positions a daemon at ``address`` tries to take now, in order; ``held``:
    index -> address of the positions taken (as just read).

    ``explicit`` (``--index``): ``preferred`` only, waiting for it however long it is
    held. Else ``preferred`` is the position the daemon's name held last (or, after
    its lease ran out, the one it held): while its own earlier incarnation holds it
    (its address there, a lease not run out yet) only that one, which frees within a
    TTL; when another daemon holds it, a replacement took it: the free positions,
    lowest first. Free, ``preferred`` comes first.
    """
    if explicit:
        return [preferred]
    if 0 <= preferred < size and held.get(preferred) == address:
        return [preferred]
    free = [i for i in range(size) if i not in held]
    if preferred in free:
        free.remove(preferred)
        free.insert(0, preferred)
    return free


def unready(slots: dict[int, str], ready: dict[int, str]) -> set[int]:
    """Positions held (``slots``: index -> address) whose holder has not marked itself
    ready (``ready``: index -> the address that marked it): it has not yet published
    what it held when it took the position, so its copies are missing from the view."""
    return {index for index, address in slots.items() if ready.get(index) != address}
