"""The daemon's heartbeat file, shared by both ends: its layout, and how its writer is doing.

The daemon writes, into its segment directory's lock file, its ``CLOCK_MONOTONIC``
seconds every 10 ms, and once its pid and the start time the kernel gives that pid
(``/proc/<pid>/stat``, field 22): ``=dqq`` at offset 0. A trainer reads it without a
call. Where it sees the daemon's process (the same pid namespace, the start time
matching, so a reused pid is not mistaken for it), the kernel says at once whether
the daemon is stopped (SIGSTOP) or dead, whatever the load; elsewhere (a trainer in
another container) the clock's age is all there is, and a loaded machine can
delay a busy daemon's clock for tenths of a second.
"""

import dataclasses
import os
import struct
import time

#: clock (float64 seconds), pid, start time (clock ticks since boot)
LAYOUT = struct.Struct("=dqq")


def pack(clock: float, pid: int, start: int) -> bytes:
    return LAYOUT.pack(clock, pid, start)


def process_state(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in ticks) of ``pid`` from /proc; None when it cannot be
    read (no such process here)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()  # the name may hold spaces and parens
    return fields[0].decode(), int(fields[19])


@dataclasses.dataclass(frozen=True)
class Beat:
    """What a trainer reads: how long ago the daemon's clock was written, and whether
    the kernel says its process is stopped or dead (None: cannot tell from here)."""

    silence: float
    stopped: bool | None


def read(fd: int) -> Beat | None:
    """The heartbeat in the open file ``fd``; None when it cannot be read."""
    try:
        clock, pid, start = LAYOUT.unpack(os.pread(fd, LAYOUT.size, 0))
    except (OSError, struct.error):
        return None
    silence = max(0.0, time.monotonic() - clock)
    state = process_state(pid) if pid > 0 else None
    if state is None or state[1] != start:
        # not to be seen from here (another pid namespace: a container), or gone (then
        # its calls fail at once: a closed socket)
        return Beat(silence, None)
    return Beat(silence, state[0] in "TtZXx")
