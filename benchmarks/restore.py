"""Restore bandwidth by tier and by topology, against TCP and Orbax, at the sizes users hold.

One state pytree (default ~256 MB: bfloat16 params with float32 Adam moments,
12 leaves, rows sharded over 4 forced CPU devices, as in datapath.py) is
snapshotted as rank 0 of a one-rank job and restored through every tier;
the same state is also snapshotted as step 1 of a second job of 2 ranks,
each copying half the rows of every array (job-wide), written over raw gRPC
as two processes of a 2-process job would (no jax.distributed needed).
Restores by regions: the client asks for the regions its target shardings
put on its devices. Into the snapshot's own layout one copy holds them box
for box and is handed over as it is; otherwise the daemon reads the shards
that meet them (from every rank's copy) and assembles a fresh segment. Each
mode reports bytes/s (GB/s, 1e9 bytes/s):

  raw_tcp          loopback TCP in this run: a sender thread os.sendfile()s
                   A's segment of the step (the file peer_transfer reads) over
                   a new 127.0.0.1 connection; this thread recv_into()s a
                   buffer allocated and touched before. The physical limit of
                   one stream.
  raw_tcp_parallel the same over data_channel.PULL_STREAMS connections at once,
                   each carrying an equal range (as the peer path does).
  peer_transfer    the peer data path alone: OpenRead on daemon A's Peer
                   service (a one-time ticket), then the daemon's own puller:
                   ranged pulls over parallel connections into the same
                   buffer, each slot hashed as its bytes land.
  restore_local    SnapshotClient.restore on A, which holds the step in its own
                   memory (checksum pass, mapping; zero-copy on the CPU backend).
  restore_local_resharded
                   the same into another partition spec: columns instead of
                   rows on the same 4 devices, so each device's region cuts
                   across all 4 row shards and A assembles it.
  restore_local_2to1
                   the 2-rank job's step restored on A (which holds both
                   ranks' copies) by this one process of 4 devices, rows: each
                   device's quarter lies in one rank's half, A assembles them.
  restore_peer     SnapshotClient.restore on C, which does not hold the step:
                   C gathers the group's holdings, pulls the segment from A over
                   the data channel, verifies every checksum, hands it over
                   (C runs --no-spread-restores: one holder, A).
  restore_peer_2holders
                   the same on E, which pulls from both holders at once, A and
                   B, each its share of the slots (--spread-restores, the
                   default); the bytes A's and B's data channels sent each
                   round (their metrics) are reported under "holder_mb".
  restore_peer_resharded
                   the columns target on C: C reads the row shards from a
                   peer's copy (Describe, OpenRead of those slots) and
                   assembles the columns.
  restore_peer_2to1
                   the 2-rank job's step on C, which holds neither rank's copy:
                   it reads both from peers and assembles the quarters.
  restore_durable  SnapshotClient.restore on D, a lone daemon that sees only the
                   durable tier: D reads the regions asked from A's Orbax
                   checkpoint of the step (all at once, straight into the
                   segment it serves) and verifies them there.
  orbax_restore    StandardCheckpointer().restore of the same state, saved once
                   by Orbax, into the same target shardings.
  orbax_restore_resharded
                   the same checkpoint restored into the columns target.

raw_tcp, raw_tcp_parallel and peer_transfer count the segment's bytes (the state's plus at most
63 bytes of alignment per shard); the other modes count the state's bytes.
Every restore ends in jax.block_until_ready, and the clock runs from the call
to the arrays being ready (peer_transfer: from OpenRead to the last byte).

Groups, and what is alive at once. The modes run in groups; each group
starts only the daemons its modes need, sets them up, runs its rounds and
stops them (their shared memory freed, this process's garbage collected and
its heap handed back) before the next group starts. Daemons (separate
processes, default --nice, as a trainer's host would run them): A holds the
step of each job a mode of the group restores, and B a replica of it where
restore_peer_2holders runs (a ring --replicas 1, B after A; without B the
ring runs --replicas 0); C and E restore from the ring and hold nothing
else; A writes the durable tier (--durable-dir DIR --durable-every-steps
1) where restore_durable runs, and D is a lone daemon on the same DIR,
started once DIR holds the step (A is stopped first when no other mode of
the group needs it). Each daemon's --memory-budget holds what it must hold
at once, counted in state-sized segments: its copies, one segment per
assembled-restore mode that runs on it (a daemon keeps what it assembled
for a rank until that rank's next restore), and one for its warm pool
(which the whole copy a peer restore pulls takes; two on C where a peer
reshard lands a pulled copy and its answer at once); --warm-pool-bytes (one state's segment per
segment a restore lands in at once by default, --warm-pool-mb) goes to the
daemons a restore lands in (A for its assembled restores, C, D, E), so what
a restore lands in is faulted in already, as on a host sized for it.

--layout together runs every mode in one group: all the daemons alive at
once (about 19 states of memory). --layout split runs the groups of
SPLIT_GROUPS, each at most 5 states (this process's state, the segments
its daemons hold, the buffer of the wire modes, the durable tier or Orbax's
checkpoint). --layout auto (the default) starts from the split groups and
merges consecutive ones while the merged group fits 70% of the room this
machine has (the state made, and its available memory beyond 2 GiB:
/proc/meminfo MemAvailable; the machine is shared), so a small state runs in
few groups: on the 2-core, 24 GiB dev VM, 256 MB in three (the 2 ranks -> 1
peer restore, whose half-state copies would make C cut whole warm segments
to size, runs alone), 1024 MB in four, 4096 MB as split. A group that does not fit the room is
refused before anything starts.
Rounds are interleaved within a group (bench_common.measure: the first mode
rotates each round, after one untimed warm-up round); modes of different
groups run one group after the other, so a ratio of two of them is not
interleaved: "ratios_across_groups" names those ratios ("groups" lists each
group's modes).

Memory, per group (under "groups", and the largest under "memory"): each
daemon's peak RSS (/proc/<pid>/status VmHWM, read before it is stopped)
against the most it held (its Status: used plus pooled bytes, sampled every
0.25 s), and this process's peak RSS (VmHWM, reset at the group's start
through /proc/self/clear_refs) against what it held before making the state
and the state's size ("client_extra_states": the states it held beyond the
state: the wire modes' buffer, a restored state, Orbax's buffers). Per
restoring mode, "client_restore_peak_states": the most one restore added to
this process's peak RSS (VmHWM reset right before the call, read once the
arrays are ready), in states: what restoring costs a trainer's memory (a
restore from memory or a peer maps the segment the daemon handed over,
counted as its pages are touched). Goals (reported, never failed on): a
daemon's peak RSS within 5% of what it holds, a bubblesnap restore within
one copy of the state.

After every restore on C or E that pulls a whole copy, DeleteSnapshots drops
the copy it pulled, so the next round pulls again (A, and B, keep their
copies, so nothing is pushed back); an assembled restore (on A, C or D)
keeps no copy, only the segment handed over, so every round reads again.
After each mode this process waits (up to 10 s plus 3 s per GB) until every
daemon's warm pool is full again, so no refill runs inside the next mode's
clock. The source every restore reports, and the step and world size it was
taken with, are checked each round. C forgets the copy but not the job, so
only the warm-up round restores on a daemon that had never seen it. A
restore on A into another world size than the step's (restore_local_2to1)
resumes the job as a new epoch: A drops later copies (none here) and, in a
ring, calls Rollback at its peers, inside the clock, as a real resume would
once; here every round, as the job never registers under its new world size.

Orbax's checkpoint and DIR are on /dev/shm (tmpfs) like the daemons'
segments, so no mode reads a disk. Medians with min-max are reported, and
ratios of medians; per restoring mode, the median ms of each phase a
restore reports (the client's call, map and place, the daemon's own as
daemon.<name>: holdings, segment, open, receive, verify, land, ...; and
"ready", until jax.block_until_ready returns). Every restore (and every
pulled segment, every TCP transfer) is compared bit for bit with the
original state, region by region, outside the timed region.

Targets: peer_transfer >= 0.5 x raw TCP (the faster of raw_tcp and
raw_tcp_parallel); restore_peer >= 5 x orbax_restore; restores into another
partition spec or from another process count at least half as fast as the
same-topology restore from the same tier (reported, never failed on).

The daemons log at WARNING to files; the report carries the first lines of
each under "daemon_log" (a ring's daemons start one after another, so
"peer N is unreachable" at start-up is expected). A watchdog thread stops
every daemon as soon as one holds more than its memory budget in its
shared-memory directory, /dev/shm has less than 2 GiB free or the machine
less than 1 GiB available, and setup gives up as soon as A logs a
replication that a peer did not take. Whatever happens, every daemon gets
SIGTERM and the work files are removed; on a failure --json prints
{"error": ..., "daemon_log": ...} and the exit code is 1. Should this
process be killed outright (SIGKILL, the OOM killer), bubblesnap.testing's
reaper kills its daemons and removes their shared memory and the work
folder.

Huge pages: --huge-dir DIR (a tmpfs mounted with huge=within_size, say
`mount -t tmpfs -o huge=within_size,size=16g tmpfs DIR` as root) adds a
last group: restore_local, restore_local_resharded and restore_peer on
daemons whose segments are in /dev/shm and on daemons whose segments are in
DIR (the same names ending in _huge), all six interleaved; reported under
"huge_pages" with the pages each daemon reported, the ratios of each huge
mode to its plain one and of the resharded restore to the same-topology one
on each, the phases (a restore's "map" is where 4 KiB pages cost most) and how
much of this process's memory was mapped with 2 MiB page-table entries after
each restore (ShmemPmdMapped). --huge-only runs that group alone.

Usage: python benchmarks/restore.py [--json] [--quick] [--mb 256] [--rounds 5]
       [--warm-pool-mb MB] [--layout auto|together|split] [--huge-dir DIR [--huge-only]]
"""

import argparse
import contextlib
import dataclasses
import gc
import itertools
import json
import math
import mmap
import os
import posixpath
import shutil
import signal
import socket
import statistics
import struct
import sys
import threading
import time
import traceback
import urllib.request

import bench_common as common
import durable_store
import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.protos import peer_pb2_grpc
from bubblesnap.protos.checksum import checksum
from bubblesnap.service.peers import data_channel
from bubblesnap.service.store import persistence
from bubblesnap.service.store.layout import build_layout
from bubblesnap.shared.sockets import recv_exact
from bubblesnap.testing import DaemonProcess, free_port, reaped_tempdir, wait_for

MODES = ("raw_tcp", "raw_tcp_parallel", "peer_transfer", "restore_local",
         "restore_local_resharded", "restore_local_2to1", "restore_peer", "restore_peer_2holders",
         "restore_peer_resharded", "restore_peer_2to1", "restore_durable", "orbax_restore",
         "orbax_restore_resharded")
#: The source a restore must report in each restoring mode.
EXPECTED_SOURCE = {"restore_local": "memory", "restore_local_resharded": "memory",
                   "restore_local_2to1": "memory", "restore_peer": "peer",
                   "restore_peer_2holders": "peer", "restore_peer_resharded": "peer",
                   "restore_peer_2to1": "peer",
                   "restore_durable": "durable"}
#: The groups of --layout split, each at most 5 states of memory, in the order they run
#: (--layout auto merges consecutive ones while they fit). Each keeps together the modes
#: whose ratio matters most where 5 states allow: the wire's limit and the peer restore,
#: a local restore and its resharded one.
SPLIT_GROUPS = (("raw_tcp", "raw_tcp_parallel", "peer_transfer", "restore_peer"),
                ("restore_peer_resharded",), ("restore_peer_2to1",), ("restore_peer_2holders",),
                ("restore_local", "restore_local_resharded"), ("restore_local_2to1",),
                ("restore_durable",), ("orbax_restore", "orbax_restore_resharded"))
#: Groups --layout auto never merges: the 2 ranks -> 1 peer restore lands half-state
#: copies on C, where other peer modes land whole states; mixed, each of its restores
#: would cut a whole warm segment to half (25-50 ms of pages freed on the dev VM), a
#: cost of the benchmark's mix, not of a host restoring one job again and again.
_NEVER_MERGED = frozenset({("restore_peer_2to1",)})
LAYOUTS = ("auto", "together", "split")
DEVICES = 4
JOB = "bench-restore"
#: The same state, snapshotted by the two ranks of another job, each copying half the rows.
JOB_2RANKS = "bench-restore-2ranks"
STEP = 1
_READY_SECONDS = 120.0
_WAIT_SECONDS = 300.0
#: Below this much free /dev/shm the watchdog stops the daemons.
_SHM_FLOOR = 2 << 30
#: Below this much available memory (MemAvailable) the watchdog stops the daemons.
_MEMORY_FLOOR = 1 << 30
#: What --layout auto leaves of the machine's available memory to everything but the
#: states it counts (this process's JAX and Python, the daemons' own), and the share of
#: the rest it takes: the machine is shared (other programs grow while this one runs).
_RESERVE = 2 << 30
_SHARE = 0.7

# What each mode needs (GroupPlan turns a group's modes into daemons and budgets).
_JOB_MODES = frozenset(MODES) - {"restore_local_2to1", "restore_peer_2to1", "orbax_restore",
                                  "orbax_restore_resharded"}
_WIDE_MODES = frozenset({"restore_local_2to1", "restore_peer_2to1"})
_WIRE_MODES = frozenset({"raw_tcp", "raw_tcp_parallel", "peer_transfer"})
_ORBAX_MODES = frozenset({"orbax_restore", "orbax_restore_resharded"})
#: Per daemon, the modes that pull a whole copy into it, and those it assembles a segment for.
_PULLS = {"C": {"restore_peer"}, "E": {"restore_peer_2holders"}}
_ASSEMBLES = {"A": {"restore_local_resharded", "restore_local_2to1"},
              "C": {"restore_peer_resharded", "restore_peer_2to1"}, "D": {"restore_durable"}}
#: Per daemon, the modes whose restore lands two states at once: a peer's copy pulled
#: whole to be cut, and the answer cut from it. (The 2 ranks -> 1 peer restore lands
#: two half-state copies: one state's warm segments, made in the size asked.)
_LANDS_TWICE = {"C": {"restore_peer_resharded"}}


class GroupPlan:
    """What one group of modes needs: the jobs A holds, the ring, the durable tier, and
    per daemon how many state-sized segments it holds at most (``slots``)."""

    def __init__(self, modes):
        self.modes = tuple(m for m in MODES if m in modes)
        wanted = set(self.modes)
        self.jobs = tuple(job for job, modes_of in ((JOB, _JOB_MODES), (JOB_2RANKS, _WIDE_MODES))
                          if wanted & modes_of)
        holders = ["A", "B"] if "restore_peer_2holders" in wanted else ["A"]
        restorers = [n for n in ("C", "E")
                     if wanted & (_PULLS.get(n, set()) | _ASSEMBLES.get(n, set()))]
        self.ring = holders + restorers if restorers or "peer_transfer" in wanted else []
        self.replicas = 1 if "B" in holders else 0
        self.durable = "restore_durable" in wanted
        #: A serves a mode beyond writing the durable tier (else it is stopped before D starts)
        self.a_serves = bool(wanted - {"restore_durable"} - _ORBAX_MODES)
        self.wire = bool(wanted & _WIRE_MODES)
        self.orbax = bool(wanted & _ORBAX_MODES)
        self.slots: dict[str, int] = {}
        if self.jobs:
            for name in holders:
                self.slots[name] = len(self.jobs)
        #: per daemon a restore lands in, the warm segments it keeps: as many as one
        #: restore lands in at once
        self.warm: dict[str, int] = {}
        for name in ("A", "C", "D", "E"):
            lands = wanted & (_PULLS.get(name, set()) | _ASSEMBLES.get(name, set()))
            if lands:  # one per assembled mode, and the warm pool's (a pulled copy takes it)
                self.warm[name] = 2 if wanted & _LANDS_TWICE.get(name, set()) else 1
                self.slots[name] = self.slots.get(name, 0) + \
                    len(wanted & _ASSEMBLES.get(name, set())) + self.warm[name]

    def footprint(self) -> int:
        """The most memory alive at once, in states: this process's state, the wire modes'
        buffer, the durable tier, Orbax's checkpoint and a restore of it, the daemons'."""
        daemons = sum(self.slots.values())
        if self.durable and not self.a_serves:  # A is gone before D lands anything
            daemons = max(self.slots["A"], daemons - self.slots["A"])
        return (1 + self.wire + daemons + (len(self.jobs) if self.durable else 0)
                + 2 * self.orbax)


def make_groups(layout: str, cap_states: float, modes=MODES) -> list[GroupPlan]:
    """The groups a run of ``layout`` makes of ``modes``, none over ``cap_states`` states."""
    if layout == "together":
        return [GroupPlan(modes)]
    groups = [GroupPlan(kept) for g in SPLIT_GROUPS if (kept := [m for m in g if m in modes])]
    if layout == "auto":
        merged = [groups[0]]
        for group in groups[1:]:
            both = GroupPlan(merged[-1].modes + group.modes)
            alone = {group.modes, merged[-1].modes} & _NEVER_MERGED
            if both.footprint() <= cap_states and not alone:
                merged[-1] = both
            else:
                merged.append(group)
        groups = merged
    return groups


def pmd_mapped_bytes() -> int:
    """This process's shared memory mapped with huge page-table entries now (2 MiB pages
    of a huge-page tmpfs: ShmemPmdMapped of /proc/self/smaps_rollup)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("ShmemPmdMapped:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """CPU time process ``pid`` has run so far, every thread's, those ended too (its
    CPU-time clock: what clock_getcpuclockid(3) makes of a pid)."""
    return time.clock_gettime(((~pid) << 3) | 2)


def reset_peak_rss() -> None:
    """Resets this process's VmHWM to its RSS now (proc(5): clear_refs, 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def mem_available() -> int:
    """MemAvailable of /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


class Daemons:
    """Starts one group's daemons and stops every one of them in :meth:`stop_all`; tracks
    the most each held (Status: used plus pooled bytes)."""

    def __init__(self, log_dir: str, tag: str, shm_parent: str = "/dev/shm"):
        self.log_dir, self.tag, self.shm_parent = log_dir, tag, shm_parent
        self.started: dict[str, DaemonProcess] = {}
        self.budgets: dict[str, int] = {}
        self.held_peak: dict[str, int] = {}
        self.warm_taken: dict[str, int] = {}

    def start(self, name: str, budget: int, warm: int, *flags: str) -> DaemonProcess:
        daemon = DaemonProcess("--memory-budget", str(budget), "--warm-pool-bytes", str(warm),
                               *flags, name=f"daemon {name}", metrics="127.0.0.1:0",
                               own_shm_dir=self.shm_parent,
                               stderr=os.path.join(self.log_dir, f"daemon-{self.tag}{name}.log"),
                               ready_timeout=_READY_SECONDS)
        self.started[name], self.budgets[name], self.held_peak[name] = daemon, budget, 0
        return daemon

    def sample(self) -> None:
        """Notes what every running daemon holds now (its peak is kept)."""
        for name, daemon in list(self.started.items()):
            if not daemon.alive():
                continue
            try:
                memory = daemon.stub.Status(pb.StatusRequest(), timeout=5).memory
            except grpc.RpcError:
                continue
            self.held_peak[name] = max(self.held_peak[name],
                                       memory.used_bytes + memory.pooled_bytes)
            self.warm_taken[name] = memory.warm_segments_taken

    def memory(self) -> dict[str, dict]:
        """Per daemon still running: its peak RSS against the most it held."""
        self.sample()
        out = {}
        for name, daemon in self.started.items():
            if not daemon.alive():
                continue
            rss, held = common.proc_bytes(daemon.proc.pid, "VmHWM"), self.held_peak[name]
            out[name] = {"peak_rss_bytes": rss, "peak_held_bytes": held,
                         "rss_vs_held": round(rss / held, 3) if held else None}
        return out

    def stop(self, name: str) -> dict:
        """Stops one daemon now; its memory row (as :meth:`memory`'s)."""
        row = self.memory().get(name, {})
        self.started[name].stop()
        return row

    def stop_all(self) -> None:
        for daemon in self.started.values():
            try:
                daemon.stop()
            except Exception as err:  # keep stopping the others
                common.log(f"stopping {daemon.name} failed: {err!r}")

    def logged(self, daemon: DaemonProcess, needle: str) -> list[str]:
        """Lines of the daemon's log that contain ``needle``."""
        return [line for line in daemon.stderr_text().splitlines() if needle in line]

    def overrun(self) -> str | None:
        """Why the run must stop now to protect the machine, or None.

        A daemon never holds more than its budget in its shared-memory
        directory; more means it leaks segments (each one lost memory until
        the daemon exits), which would end in the OOM killer.
        """
        for name, daemon in list(self.started.items()):  # the watchdog's thread: copy first
            directory = daemon.ready.get("shm_dir")
            if not directory or not daemon.alive():
                continue
            try:
                held = sum(e.stat().st_size for e in os.scandir(directory) if e.is_file())
            except OSError:
                continue
            limit = self.budgets[name] + (64 << 20)
            if held > limit:
                return (f"{daemon.name} holds {held / 1e6:.0f} MB in {directory}, over its "
                        f"{self.budgets[name] / 1e6:.0f} MB memory budget: it leaks segments")
        stat = os.statvfs("/dev/shm")
        if stat.f_bavail * stat.f_frsize < _SHM_FLOOR:
            return f"/dev/shm has less than {_SHM_FLOOR >> 30} GiB free"
        if mem_available() < _MEMORY_FLOOR:
            return f"the machine has less than {_MEMORY_FLOOR >> 30} GiB of memory available"
        return None

    def log_stacks(self) -> None:
        """Logs what every running daemon's threads are doing: after a failure, what one
        that stopped answering waits on."""
        for daemon in self.started.values():
            common.log(daemon.dump_stacks())

    def problems(self) -> dict[str, list[str]]:
        """WARNING/ERROR lines each daemon logged (at most 20), and unclean exits."""
        found = {}
        for name, daemon in self.started.items():
            lines = [line.rstrip() for line in daemon.stderr_text().splitlines() if line.strip()]
            if daemon.exit_code not in (0, None):
                lines.append(f"exited with code {daemon.exit_code}")
            if lines:
                found[f"{self.tag}{name}"] = lines[:20]
        return found


class Watchdog:
    """Stops every daemon as soon as :meth:`Daemons.overrun` says the machine is at risk;
    samples what each holds meanwhile."""

    def __init__(self, daemons: Daemons):
        self.daemons = daemons
        self.reason: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            reason = self.daemons.overrun()
            if reason:
                self.reason = reason
                common.log(f"watchdog: {reason}; stopping the daemons")
                for daemon in list(self.daemons.started.values()):
                    if daemon.proc.poll() is None:
                        daemon.proc.send_signal(signal.SIGTERM)
                return
            self.daemons.sample()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class RawSender:
    """A thread that os.sendfile()s one file to every connection it accepts."""

    def __init__(self, path: str, nbytes: int):
        self.path, self.nbytes = path, nbytes
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = self._sock.getsockname()
        self.error: Exception | None = None
        self._thread = threading.Thread(target=self._serve, name="raw-tcp-send", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._send, args=(conn,), daemon=True).start()

    def _send(self, conn) -> None:
        """Sends the [start, stop) range the connection asks for (16 bytes, two u64)."""
        try:
            with conn:
                start, stop = struct.unpack("!QQ", recv_exact(conn, 16))
                fd = os.open(self.path, os.O_RDONLY)
                try:
                    sent = start
                    while sent < stop:
                        n = os.sendfile(conn.fileno(), fd, sent, stop - sent)
                        if n == 0:
                            raise ConnectionError(f"{self.path} ended after {sent} bytes")
                        sent += n
                finally:
                    os.close(fd)
        except OSError as err:
            self.error = err

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5)



def by_columns(state):
    """The abstract target of ``state`` sharded by columns instead of rows, over the same
    devices (no copy: a restore fills it, and its bytes are checked against ``state``)."""
    import jax
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=(
        jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec(None, "x")))),
        state)


def _box(index, shape) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(d)[:2] for s, d in zip(index, shape, strict=True))


def _bits(data) -> np.ndarray:
    """A shard's elements as unsigned integers of their size: compared bit for bit (a
    float compare would call -0.0 and 0.0 equal)."""
    array = np.asarray(data)
    return array.view(np.dtype(f"u{array.dtype.itemsize}"))


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays of one shape are equal, compared some rows at a time, so the
    comparison's temporary stays small whatever the size."""
    if a.shape != b.shape:
        return False
    if a.ndim == 0 or a.size == 0:
        return bool(np.array_equal(a, b))
    rows = max(1, (32 << 20) // max(1, a[0].nbytes))
    return all(np.array_equal(a[i:i + rows], b[i:i + rows]) for i in range(0, len(a), rows))


def same_regions(expected, got, target) -> bool:
    """Whether ``got`` has ``target``'s tree, shapes, dtypes and shardings, and every shard
    it holds equals, bit for bit, ``expected`` (the state in any sharding) at the same
    global index: compared where each of its shards meets each of ``expected``'s, so no
    array is gathered or copied."""
    import jax
    if jax.tree_util.tree_structure(got) != jax.tree_util.tree_structure(target):
        return False
    for want, have, like in zip(jax.tree_util.tree_leaves(expected),
                                jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(target),
                                strict=True):
        if have.shape != like.shape or have.dtype != like.dtype or \
                have.sharding != like.sharding:
            return False
        sources = [(_box(s.index, want.shape), _bits(s.data)) for s in want.addressable_shards
                   if s.replica_id == 0]
        for shard in have.addressable_shards:
            box, data = _box(shard.index, have.shape), _bits(shard.data)
            covered = 0
            for other, theirs in sources:
                meet = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, other, strict=True)]
                if any(lo >= hi for lo, hi in meet):
                    continue
                mine = data[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(meet, box,
                                                                                   strict=True))]
                them = theirs[tuple(slice(lo - c, hi - c)
                                    for (lo, hi), (c, _) in zip(meet, other, strict=True))]
                if not _equal(mine, them):
                    return False
                covered += math.prod(hi - lo for lo, hi in meet)
            if covered != math.prod(b - a for a, b in box):
                return False
    return True


def half_rows(state, shards, rank: int) -> tuple[list[pb.TensorSpec], list[list[np.ndarray]]]:
    """What rank ``rank`` of a 2-rank job holding ``state`` copies: half the rows of every
    leaf (rank 0 the first), job-wide, as one shard; and per tensor the row shards of
    ``shards`` (common.shard_bytes) that make up its bytes, in row order (rows are
    contiguous in C order, so no gather is needed)."""
    import jax
    specs, parts = [], []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = "/".join(str(k.key) for k in path)
        half = leaf.shape[0] // 2
        start, stop = rank * half, (rank + 1) * half
        box = [pb.Slice(start=start, stop=stop)] + [pb.Slice(start=0, stop=d)
                                                    for d in leaf.shape[1:]]
        specs.append(pb.TensorSpec(name=name, dtype=np.dtype(leaf.dtype).name,
                                   global_shape=leaf.shape, job_wide=True,
                                   shards=[pb.ShardSpec(index=box, nbytes=leaf.nbytes // 2)]))
        parts.append([data for (n, index), data in sorted(shards.items())
                      if n == name and start <= index[0][0] < stop])
    return specs, parts


def copy_segment(directory: str, job: str, rank: int, step: int) -> str:
    """The segment file in which a daemon whose segments are in ``directory`` holds its
    copy of ``step`` of ``rank`` of ``job`` (found by the record beside it)."""
    for name in sorted(os.listdir(directory)):
        if not name.endswith(persistence.SUFFIX):
            continue
        try:
            record = persistence.read(os.path.join(directory, name))
        except (persistence.Unreadable, persistence.NewerVersion):
            continue
        if (record.job, record.rank, record.step) == (job, rank, step):
            return os.path.join(directory, name[:-len(persistence.SUFFIX)])
    raise RuntimeError(f"no copy of step {step} of rank {rank} of {job!r} in {directory}")


@dataclasses.dataclass
class Results:
    """What the groups' rounds add up to, mode by mode."""

    seconds: dict = dataclasses.field(default_factory=dict)
    matches: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(MODES, True))
    sources: dict = dataclasses.field(default_factory=lambda: {m: [] for m in EXPECTED_SOURCE})
    #: per restoring mode, each round's phases (Restored.phases, and "ready")
    phases: dict = dataclasses.field(default_factory=lambda: {m: [] for m in EXPECTED_SOURCE})
    #: per whole-copy peer restore, each round's MB sent by A's and B's data channels
    holder_mb: dict = dataclasses.field(default_factory=lambda: {
        "restore_peer": [], "restore_peer_2holders": []})
    settle_timeouts: int = 0  # rounds whose warm pools were not full again in time
    problems: list = dataclasses.field(default_factory=list)
    segment_bytes: int = 0
    #: per daemon, warm segments its restores and arrivals took (every group's)
    warm_taken: dict = dataclasses.field(default_factory=dict)
    #: per group: its modes, the daemons' and this process's memory
    groups: list = dataclasses.field(default_factory=list)
    #: per restoring mode, the most one restore added to this process's peak RSS, in states
    restore_peaks: dict = dataclasses.field(default_factory=dict)
    #: this process's peak RSS in the group running, before the last reset of VmHWM
    group_peak: int = 0
    #: per restoring mode, the most of this process's shared memory mapped with huge
    #: page-table entries right after a restore (ShmemPmdMapped, smaps_rollup)
    pmd_mapped: dict = dataclasses.field(default_factory=dict)
    #: per restoring mode (Orbax's too), each timed round's (CPU seconds of this process
    #: and the group's daemons, wall seconds)
    cpu: dict = dataclasses.field(default_factory=dict)


class Bench:
    """One group: its daemons, clients and checkpointer, and one timing function per mode."""

    def __init__(self, plan: GroupPlan, state, results: Results, daemons: Daemons,
                 work_dir: str, warm_bytes: int, store_dir: str = ""):
        self.plan, self.state, self.results = plan, state, results
        self.target = common.restore_target(state)
        # Columns instead of rows: every device's region cuts across every row shard held.
        self.resharded_target = by_columns(state)
        self.shards = common.shard_bytes(state)
        self.state_bytes = sum(s.nbytes for s in self.shards.values())
        self.daemons = daemons
        self.a = self.b = self.c = self.d = self.e = None
        self._closers = []
        try:
            self._setup(work_dir, warm_bytes, store_dir)
        except BaseException:
            self.close()
            raise

    # -- setup --------------------------------------------------------------------------

    def _start(self, name: str, warm_bytes: int, *flags: str) -> DaemonProcess:
        # A state-sized segment with room for its alignment (at most 63 bytes a shard)
        unit = self.state_bytes + (4 << 20)
        budget = self.plan.slots[name] * unit + (64 << 20)
        warm = warm_bytes * self.plan.warm.get(name, 0)
        return self.daemons.start(name, budget, warm, *flags)

    def _setup(self, work_dir: str, warm_bytes: int, store_dir: str) -> None:
        """``store_dir``: an object store's folder for the durable tier (and Orbax's
        checkpoint, on gs://: Orbax cannot write s3://); empty: both in ``work_dir``."""
        plan = self.plan
        durable_dir = posixpath.join(store_dir or work_dir, "durable")
        durable = ("--durable-dir", durable_dir, "--durable-every-steps", "1")
        ring_flags = {}
        if plan.ring:
            peers = ",".join(f"127.0.0.1:{free_port()}" for _ in plan.ring)
            ring_flags = {name: ("--peers", peers, "--replicas", str(plan.replicas), "--index",
                                 str(i)) for i, name in enumerate(plan.ring)}
        common.log(f"group {', '.join(plan.modes)}: starting "
                   f"{', '.join(plan.slots) or 'no daemons'}"
                   + (f" (ring {', '.join(plan.ring)}, --replicas {plan.replicas})"
                      if plan.ring else ""))
        for name in ("A", "B", "C", "E"):
            if name not in plan.slots:
                continue
            extra = durable if name == "A" and plan.durable else ()
            if name == "C":
                extra = ("--no-spread-restores",)
            setattr(self, name.lower(), self._start(name, warm_bytes, *ring_flags.get(name, ()),
                                                    *extra))
        if plan.jobs:
            self._snapshot_all()
        if plan.wire:
            self._setup_wire()
        if plan.durable:
            if not plan.a_serves:
                self.results.groups[-1]["daemons"]["A"] = self.daemons.stop("A")
                self.a = None
            self.d = self._start("D", warm_bytes, *durable)
            self.durable_client = self._client(self.d)
        if plan.orbax:
            import orbax.checkpoint as ocp
            self.checkpointer = ocp.StandardCheckpointer()
            self._closers.append(self.checkpointer.close)
            self.orbax_path = posixpath.join(
                store_dir if store_dir.startswith("gs://") else work_dir, "orbax")
            common.log(f"saving the state with Orbax to {self.orbax_path}")
            self.checkpointer.save(self.orbax_path, self.state)
            self.checkpointer.wait_until_finished()
        if self.a is not None:
            self.trainer = self._client(self.a)
            self.wide_local = self._client(self.a, JOB_2RANKS)
        if self.c is not None:
            self.peer_client, self.wide_peer = self._client(self.c), \
                self._client(self.c, JOB_2RANKS)
        if self.e is not None:
            self.spread_client = self._client(self.e)
        self._settle_all()

    def _client(self, daemon, job=JOB):
        from bubblesnap.clients.jax import ClientOptions, SnapshotClient
        made = SnapshotClient(job, options=ClientOptions(daemon=daemon.address,
                                                         restore_timeout_seconds=600))
        self._closers.append(made.close)
        return made

    def _snapshot_all(self) -> None:
        """Snapshots the group's jobs on A and waits until every copy is where the group
        wants it (A, and B) and, with the durable tier, written there."""
        from bubblesnap.clients.jax import ClientOptions, SnapshotClient
        if JOB in self.plan.jobs:
            common.log(f"snapshotting step {STEP} of rank 0 on A")
            # A client of its own, closed at once: its mapping of the segment it wrote
            # would count in this process's memory for the whole group.
            writer = SnapshotClient(JOB, options=ClientOptions(daemon=self.a.address,
                                                               restore_timeout_seconds=600))
            try:
                result = writer.snapshot(STEP, self.state, wait=True)
            finally:
                writer.close()
            if result is None or not result.taken:
                raise RuntimeError(f"the snapshot was not taken: {getattr(result, 'reason', '')}")
        if JOB_2RANKS in self.plan.jobs:
            common.log(f"snapshotting step {STEP} of the 2 ranks of {JOB_2RANKS} on A, each "
                       "copying half the rows")
            for rank in range(2):
                self._snapshot_half(rank)
        copies = 1 + self.plan.replicas
        for job in self.plan.jobs:
            for rank in ((0,) if job == JOB else (0, 1)):
                wait_for(lambda job=job, rank=rank: self._copies(self.a, job, rank) == copies,
                         f"step {STEP} of rank {rank} of {job} held {copies} times",
                         _WAIT_SECONDS, failed=lambda: "; ".join(
                             self.daemons.logged(self.a, "did not take")[:1]))
            if self.plan.durable:  # written before the clock runs
                wait_for(lambda job=job: STEP in self._status(self.a, job).durable_steps,
                         f"A to write step {STEP} of {job} to the durable tier", _WAIT_SECONDS)
        if self.b is not None:
            wait_for(lambda: self.b.stub.Status(pb.StatusRequest(job=JOB), timeout=10).jobs,
                     "B to hold the replica", _WAIT_SECONDS)
        common.log("the group's copies are held")

    def _setup_wire(self) -> None:
        self._peer_channel = grpc.insecure_channel(self.a.ready["peer_address"])
        self._closers.append(self._peer_channel.close)
        self.peer_stub = peer_pb2_grpc.PeerStub(self._peer_channel)
        opened = self._open_read()
        self.segment_bytes = self.results.segment_bytes = opened.segment_bytes
        self.layout = build_layout(opened.tensors)
        self.checksums = tuple(opened.checksums)
        # One buffer, touched before, for every transfer: the wire modes' one copy.
        self.buffer = np.empty(self.segment_bytes, np.uint8)
        self.buffer.fill(0)
        self._pull(opened)
        if not self._buffer_matches():
            raise RuntimeError("the segment pulled from A does not hold the state")
        # Raw TCP sends the very file peer_transfer reads: A's segment of the copy.
        self.raw_path = copy_segment(self.a.ready["shm_dir"], JOB, 0, STEP)
        if os.path.getsize(self.raw_path) != self.segment_bytes:
            raise RuntimeError(f"{self.raw_path} is not the {self.segment_bytes}-byte segment")
        self.sender = RawSender(self.raw_path, self.segment_bytes)
        self._closers.append(self.sender.close)

    def close(self) -> None:
        for close in reversed(self._closers):
            try:
                close()
            except Exception as err:
                common.log(f"closing failed: {err!r}")
        self._closers = []

    @staticmethod
    def _status(daemon, job: str):
        return daemon.stub.Status(pb.StatusRequest(job=job), timeout=10).jobs[0]

    def _copies(self, daemon, job: str, rank: int) -> int:
        return max((r.copies for s in self._status(daemon, job).steps if s.step == STEP
                    for r in s.ranks if r.rank == rank), default=0)

    def _snapshot_half(self, rank: int) -> None:
        """Rank ``rank`` of JOB_2RANKS takes step STEP on A over raw gRPC, as a process of
        a 2-process job would: it registers its half of every array and writes it."""
        specs, parts = half_rows(self.state, self.shards, rank)
        stub = self.a.stub
        stub.Register(pb.RegisterRequest(job=JOB_2RANKS, rank=rank, world_size=2,
                                         tensors=specs), timeout=30)
        staging = stub.BeginStep(pb.BeginStepRequest(job=JOB_2RANKS, rank=rank, step=STEP),
                                 timeout=30)
        with open(staging.segment_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            for slot in staging.slots:
                offset = slot.offset
                for piece in parts[slot.tensor]:
                    m[offset:offset + piece.nbytes] = piece
                    offset += piece.nbytes
        stub.CommitStep(pb.CommitStepRequest(job=JOB_2RANKS, rank=rank, step=STEP), timeout=600)

    def _open_read(self):
        return self.peer_stub.OpenRead(ppb.OpenReadRequest(job=JOB, rank=0, step=STEP),
                                       timeout=30)

    def _buffer_matches(self) -> bool:
        """Every slot of the buffer matches its checksum and the original shard."""
        slots = self.layout.slots()
        if len(slots) != len(self.shards) or len(self.checksums) != len(slots):
            return False
        for (t, s, offset, nbytes), expected in zip(slots, self.checksums, strict=True):
            tensor = self.layout.tensors[t]
            data = self.buffer[offset:offset + nbytes]
            original = self.shards.get((tensor.name, tensor.shards[s].index))
            if checksum(data) != expected or original is None or \
                    not _equal(data, original):
                return False
        return True

    def _check(self, mode: str, restored, target, world_size: int = 1) -> None:
        """Outside the clock: the source, the step (and the world size it was taken with)
        and the bytes of a restore, against the state, region by region."""
        results = self.results
        if mode in EXPECTED_SOURCE:
            results.sources[mode].append(restored.source)
            if restored.source != EXPECTED_SOURCE[mode]:
                results.problems.append(f"{mode}: restored from {restored.source!r}, expected "
                                        f"{EXPECTED_SOURCE[mode]!r}")
            if (restored.step, restored.world_size) != (STEP, world_size):
                results.problems.append(f"{mode}: restored step {restored.step} of "
                                        f"{restored.world_size} ranks, not {STEP} of "
                                        f"{world_size}")
                results.matches[mode] = False
            restored = restored.state
        if not same_regions(self.state, restored, target):
            results.matches[mode] = False
            results.problems.append(f"{mode}: the restored state differs from the original")

    def _delete_copy(self, daemon, mode: str) -> None:
        try:
            daemon.stub.DeleteSnapshots(pb.DeleteSnapshotsRequest(job=JOB, steps=[STEP]),
                                        timeout=30)
        except grpc.RpcError as err:
            self.results.problems.append(f"{mode}: DeleteSnapshots on {daemon.name} failed: "
                                         f"{err.code().name}: {err.details()}")

    def _settle_all(self) -> None:
        """Waits until every daemon's warm pool is full again: refilling one pre-faults a
        state's worth of pages, which must not run inside the next mode's clock (the
        modes keep their neighbours as the order rotates)."""
        gc.collect()  # a restore's arrays in a cycle would keep the segment it mapped
        deadline = time.monotonic() + 10 + 3 * self.state_bytes / 1e9
        for name, segments in self.plan.warm.items():
            daemon = getattr(self, name.lower())
            if daemon is not None and not self._refilled(daemon, segments, deadline):
                self.results.settle_timeouts += 1

    def _refilled(self, daemon, segments: int, deadline: float) -> bool:
        """Whether ``daemon``'s warm pool holds the ``segments`` states one restore lands
        in before ``deadline`` (the pool makes them in the sizes asked lately, each at
        least the state's bytes, up to its target). A Status answered only after the
        deadline counts as not: a starved daemon (a loaded host, the whole test suite
        beside it) once took over 10 s to answer one."""
        while (left := deadline - time.monotonic()) > 0:
            try:
                memory = daemon.stub.Status(pb.StatusRequest(), timeout=left).memory
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    return False
                raise
            if memory.warm_bytes >= min(memory.warm_pool_bytes, segments * self.state_bytes):
                return True
            time.sleep(0.02)
        return False

    def _peak_reset(self) -> int:
        """This process's RSS now, its peak reset to it (before a restore's clock); the
        group's peak so far is kept first."""
        self.results.group_peak = max(self.results.group_peak, common.proc_bytes("self", "VmHWM"))
        reset_peak_rss()
        return common.proc_bytes("self", "VmRSS")

    def _cpu_now(self) -> float:
        """CPU seconds this process and the group's running daemons have run so far."""
        return time.process_time() + sum(cpu_seconds(d.proc.pid)
                                         for d in self.daemons.started.values() if d.alive())

    def _cpu_note(self, mode: str, cpu_before: float, elapsed: float) -> None:
        self.results.cpu.setdefault(mode, []).append((self._cpu_now() - cpu_before, elapsed))

    def _peak_note(self, mode: str, before: int) -> None:
        """Notes what the restore just done added to this process's peak RSS, in states:
        what restoring costs a trainer's memory (a restore mapped from a daemon's segment
        counts its pages as they are touched)."""
        grown = (common.proc_bytes("self", "VmHWM") - before) / self.state_bytes
        peaks = self.results.restore_peaks
        peaks[mode] = max(peaks.get(mode, 0.0), round(grown, 3))
        pmd = self.results.pmd_mapped
        pmd[mode] = max(pmd.get(mode, 0), pmd_mapped_bytes())

    # -- the modes: each returns the seconds it timed -------------------------------------

    def raw_tcp(self) -> float:
        return self._raw_tcp(1)

    def raw_tcp_parallel(self) -> float:
        return self._raw_tcp(data_channel.PULL_STREAMS)

    def _raw_tcp(self, streams: int) -> float:
        bounds = [self.segment_bytes * i // streams for i in range(streams + 1)]

        def receive(start: int, stop: int) -> None:
            with socket.create_connection(self.sender.address, timeout=60) as conn:
                conn.sendall(struct.pack("!QQ", start, stop))
                view, got = memoryview(self.buffer), start
                while got < stop:
                    n = conn.recv_into(view[got:stop])
                    if n == 0:
                        raise ConnectionError(f"raw TCP sender closed after {got} bytes "
                                              f"({self.sender.error})")
                    got += n
                del view

        self.buffer[:] = 0  # outside the clock: what matches after was sent this round
        started = time.perf_counter()
        threads = [threading.Thread(target=receive, args=(a, b))
                   for a, b in itertools.pairwise(bounds[1:])]
        for t in threads:
            t.start()
        receive(bounds[0], bounds[1])
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - started
        if not self._buffer_matches():
            mode = "raw_tcp" if streams == 1 else "raw_tcp_parallel"
            self.results.matches[mode] = False
            self.results.problems.append(f"{mode}: the received bytes differ from the state")
        return elapsed

    def _pull(self, opened) -> None:
        """The daemon's own peer data path: parallel ranged pulls, slots hashed as they land."""
        slots = [(o, n) for _, _, o, n in build_layout(opened.tensors).slots()]
        fill = data_channel.puller(opened.data_address, opened.ticket, None, 60, "the segment")
        digests = fill(self.buffer[:opened.segment_bytes], slots)
        if tuple(digests) != tuple(opened.checksums):
            self.results.problems.append("peer_transfer: checksums of the pulled slots differ")

    def peer_transfer(self) -> float:
        self.buffer[:] = 0
        started = time.perf_counter()
        opened = self._open_read()
        self._pull(opened)
        elapsed = time.perf_counter() - started
        if opened.segment_bytes != self.segment_bytes or not self._buffer_matches():
            self.results.matches["peer_transfer"] = False
            self.results.problems.append("peer_transfer: the pulled segment differs from "
                                         "the state")
        return elapsed

    def restore_local(self) -> float:
        return self._restore("restore_local", self.trainer)

    def restore_local_resharded(self) -> float:
        return self._restore("restore_local_resharded", self.trainer, resharded=True)

    def restore_local_2to1(self) -> float:
        return self._restore("restore_local_2to1", self.wide_local, world_size=2)

    # A daemon keeps no copy of what it assembles (only the segment handed over), so only
    # the same-topology restore on C or E, which installs the copy it pulls, needs it
    # dropped for the next round to pull again.
    def restore_peer(self) -> float:
        return self._restore_whole_copy("restore_peer", self.peer_client, self.c, "A")

    def restore_peer_2holders(self) -> float:
        return self._restore_whole_copy("restore_peer_2holders", self.spread_client, self.e,
                                        "AB")

    def _restore_whole_copy(self, mode: str, client, daemon, senders: str) -> float:
        """A restore that pulls the whole copy; ``senders``: which of A and B must have sent
        bytes of it (outside the clock, from their metrics; a daemon the group lacks sent
        none)."""
        holders = (self.a, self.b)
        before = [_sent_bytes(d) for d in holders]
        elapsed = self._restore(mode, client, settle=False)
        sent = [_sent_bytes(d) - b for d, b in zip(holders, before, strict=True)]
        self.results.holder_mb[mode].append([round(n / 1e6, 1) for n in sent])
        if "".join(name for name, n in zip("AB", sent, strict=True) if n > 0) != senders:
            self.results.problems.append(f"{mode}: A and B sent {sent} bytes; expected bytes "
                                         f"from {' and '.join(senders)} only")
        gc.collect()  # the restored arrays map the pulled copy's segment: let it go first
        self._delete_copy(daemon, mode)
        self._settle_all()
        return elapsed

    def restore_peer_resharded(self) -> float:
        return self._restore("restore_peer_resharded", self.peer_client, resharded=True)

    def restore_peer_2to1(self) -> float:
        return self._restore("restore_peer_2to1", self.wide_peer, world_size=2)

    def restore_durable(self) -> float:
        return self._restore("restore_durable", self.durable_client)

    def _restore(self, mode: str, client, resharded: bool = False, world_size: int = 1,
                 settle: bool = True) -> float:
        import jax
        target = self.resharded_target if resharded else self.target
        before = self._peak_reset()
        cpu_before = self._cpu_now()
        started = time.perf_counter()
        restored = client.restore(target)
        returned = time.perf_counter()
        jax.block_until_ready(restored.state)
        elapsed = time.perf_counter() - started
        self._cpu_note(mode, cpu_before, elapsed)
        self._peak_note(mode, before)
        self.results.phases[mode].append({**restored.phases,
                                          "ready": elapsed - (returned - started)})
        self._check(mode, restored, target, world_size)
        del restored
        if settle:
            self._settle_all()
        return elapsed

    def orbax_restore(self) -> float:
        return self._orbax("orbax_restore", self.target)

    def orbax_restore_resharded(self) -> float:
        return self._orbax("orbax_restore_resharded", self.resharded_target)

    def _orbax(self, mode: str, target) -> float:
        import jax
        before = self._peak_reset()
        cpu_before = self._cpu_now()
        started = time.perf_counter()
        restored = self.checkpointer.restore(self.orbax_path, target)
        jax.block_until_ready(restored)
        elapsed = time.perf_counter() - started
        self._cpu_note(mode, cpu_before, elapsed)
        self._peak_note(mode, before)
        self._check(mode, restored, target)
        return elapsed


def _sent_bytes(daemon) -> float:
    """What ``daemon``'s data channel sent so far (bubblesnap_data_sent_bytes_total); 0
    for a daemon the group does not have."""
    if daemon is None:
        return 0.0
    text = urllib.request.urlopen(f"http://{daemon.ready['metrics']}/metrics",
                                  timeout=10).read().decode()
    return next(s.value for family in text_string_to_metric_families(text)
                for s in family.samples if s.name == "bubblesnap_data_sent_bytes_total")


#: name -> (the mode, the modes it is measured against: the fastest of them)
RATIOS = {
    # against the faster of one stream and as many streams as the peer path uses
    "peer_transfer_vs_raw_tcp": ("peer_transfer", ("raw_tcp", "raw_tcp_parallel")),
    "restore_peer_vs_orbax": ("restore_peer", ("orbax_restore",)),
    "restore_peer_vs_peer_transfer": ("restore_peer", ("peer_transfer",)),
    # issue 13's goal: a peer restore end to end at the wire's speed
    "restore_peer_vs_raw_tcp_parallel": ("restore_peer", ("raw_tcp_parallel",)),
    # the same from both holders at once
    "restore_peer_2holders_vs_raw_tcp_parallel": ("restore_peer_2holders", ("raw_tcp_parallel",)),
    "restore_peer_2holders_vs_restore_peer": ("restore_peer_2holders", ("restore_peer",)),
    "restore_local_vs_orbax": ("restore_local", ("orbax_restore",)),
    "restore_durable_vs_orbax": ("restore_durable", ("orbax_restore",)),
    # another partition spec and another process count, against the same topology
    "resharded_vs_same_local": ("restore_local_resharded", ("restore_local",)),
    "resharded_vs_same_peer": ("restore_peer_resharded", ("restore_peer",)),
    "2to1_vs_same_local": ("restore_local_2to1", ("restore_local",)),
    "2to1_vs_same_peer": ("restore_peer_2to1", ("restore_peer",)),
    # each against Orbax restoring into the same target shardings
    "restore_local_resharded_vs_orbax": ("restore_local_resharded", ("orbax_restore_resharded",)),
    "restore_peer_resharded_vs_orbax": ("restore_peer_resharded", ("orbax_restore_resharded",)),
    "restore_local_2to1_vs_orbax": ("restore_local_2to1", ("orbax_restore",)),
    "restore_peer_2to1_vs_orbax": ("restore_peer_2to1", ("orbax_restore",)),
}


#: Each target: the ratio it is judged on and the least it must reach.
TARGETS = {
    "peer_transfer_ge_50pct_raw_tcp": ("peer_transfer_vs_raw_tcp", 0.5),
    "restore_peer_ge_5x_orbax_restore": ("restore_peer_vs_orbax", 5),
    # the goal: another spec or process count at least half as fast
    "resharded_local_ge_50pct_same": ("resharded_vs_same_local", 0.5),
    "resharded_peer_ge_50pct_same": ("resharded_vs_same_peer", 0.5),
    "2to1_local_ge_50pct_same": ("2to1_vs_same_local", 0.5),
    "2to1_peer_ge_50pct_same": ("2to1_vs_same_peer", 0.5),
    # issue 13's goals (reported, never failed on)
    "restore_peer_ge_80pct_raw_tcp_parallel": ("restore_peer_vs_raw_tcp_parallel", 0.8),
    "restore_durable_ge_orbax": ("restore_durable_vs_orbax", 1.0),
    "restore_local_ge_20x_orbax": ("restore_local_vs_orbax", 20),
}


def summarize(results: Results, state_bytes: int, rounds: int, daemon_problems: dict,
              memory: dict, storage: str) -> dict:
    """The report: the modes run, the ratios and targets of those among them."""
    seconds = {mode: results.seconds[mode] for mode in MODES if mode in results.seconds}
    modes, med = common.bandwidths(seconds, lambda mode: results.segment_bytes if mode in
                                   _WIRE_MODES else state_bytes)
    ratios = {name: med[mode] / max(med[m] for m in against)
              for name, (mode, against) in RATIOS.items()
              if mode in med and all(m in med for m in against)}
    group_of = {mode: i for i, group in enumerate(results.groups) for mode in group["modes"]}
    across = [name for name, (mode, against) in RATIOS.items()
              if name in ratios and any(group_of[m] != group_of[mode] for m in against)]
    return {
        "benchmark": "restore", "state_bytes": state_bytes,
        "segment_bytes": results.segment_bytes, "leaves": common.STATE_LEAVES,
        "devices": DEVICES, "rounds": rounds, "modes": modes,
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "ratios_across_groups": across,
        "meets_targets": {name: ratios[ratio] >= least
                          for name, (ratio, least) in TARGETS.items() if ratio in ratios},
        # the timed rounds' (the first is the warm-up's)
        "phases": common.phase_medians({m: r[1:] or r for m, r in results.phases.items()}),
        "cpu": cpu_report(results.cpu),
        "matches": {mode: same for mode, same in results.matches.items() if mode in seconds},
        "sources": results.sources,
        "holder_mb": results.holder_mb,
        "warm_pool_not_refilled": results.settle_timeouts,
        "groups": results.groups,
        "memory": memory,
        "storage": storage,
        "machine_memory": common.machine_memory(),
        "problems": results.problems,
        "daemon_log": daemon_problems,
    }


def cpu_report(recorded: dict[str, list[tuple[float, float]]]) -> dict[str, dict]:
    """Per mode, over its timed rounds: the median CPU ms this process and the daemons
    spent on one restore, and the median cores that kept busy (CPU over wall time: at
    the machine's core count, a restore is bound by the CPU, not by waiting)."""
    out = {}
    for mode, rounds in recorded.items():
        timed = rounds[1:] or rounds
        out[mode] = {"median_ms": round(statistics.median(c for c, _ in timed) * 1e3, 1),
                     "cores_busy": round(statistics.median(c / w for c, w in timed), 2)}
    return out


def memory_report(results: Results, state_bytes: int, baseline: int, layout: str,
                  available: int, cap_states: float) -> dict:
    """The largest of the groups' memory figures, and whether they meet the goals."""
    daemons = [row for group in results.groups for row in group["daemons"].values()
               if row.get("peak_held_bytes")]
    client_peak = max(group["client_peak_rss_bytes"] for group in results.groups)
    worst = max((row["rss_vs_held"] for row in daemons), default=None)
    extra = (client_peak - baseline - state_bytes) / state_bytes
    # bubblesnap's restores (Orbax's are reported beside them, as the baseline)
    ours = [peak for mode, peak in results.restore_peaks.items() if mode in EXPECTED_SOURCE]
    return {
        "layout": layout, "available_bytes_at_start": available,
        "cap_states": round(cap_states, 2), "state_bytes": state_bytes,
        "client_baseline_rss_bytes": baseline, "client_peak_rss_bytes": client_peak,
        # copies of the state this process held at its peak beyond the state itself (the
        # wire modes' buffer, a restored state, Orbax's buffers)
        "client_extra_states": round(extra, 3),
        # per mode, the most one restore added to this process's peak RSS, in states
        "client_restore_peak_states": {m: results.restore_peaks[m] for m in MODES
                                       if m in results.restore_peaks},
        "daemon_peak_rss_bytes": max((row["peak_rss_bytes"] for row in daemons), default=0),
        "daemon_peak_held_bytes": max((row["peak_held_bytes"] for row in daemons), default=0),
        "daemon_rss_vs_held_max": worst,
        "meets_targets": {
            "daemon_rss_within_5pct_of_held": worst is not None and worst <= 1.05,
            # a restore costs the trainer at most one copy of the state (5% slack: the
            # process's own allocations while it runs)
            "client_restore_within_one_copy": max(ours, default=0.0) <= 1.05,
        },
    }


def print_restore_table(report: dict) -> None:
    common.print_table(report, f"state: {report['state_bytes'] / 1e6:.0f} MB in "
                               f"{report['leaves']} leaves on {report['devices']} CPU devices, "
                               f"{report['rounds']} interleaved rounds", report["matches"])
    memory = report["memory"]
    print(f"layout {memory['layout']}: " + "; ".join(
        ", ".join(g["modes"]) for g in report["groups"]))
    if report["ratios_across_groups"]:
        print("ratios of modes in different groups (not interleaved): "
              + ", ".join(report["ratios_across_groups"]))
    for i, group in enumerate(report["groups"], 1):
        print(f"group {i}: this process peak RSS {group['client_peak_rss_bytes'] / 1e6:.0f} MB; "
              + "; ".join(f"{name} peak RSS {row['peak_rss_bytes'] / 1e6:.0f} MB, held "
                          f"{row['peak_held_bytes'] / 1e6:.0f} MB"
                          for name, row in group["daemons"].items()))
    for name, met in memory["meets_targets"].items():
        print(f"{name:<36}{'yes' if met else 'NO'}")
    for mode, sources in report["sources"].items():
        print(f"{mode} sources: {', '.join(sorted(set(sources)))}")
    for mode, rounds in report["holder_mb"].items():
        print(f"{mode}: MB sent by A, B per round: {rounds}")
    for mode, spent in report["phases"].items():
        print(f"{mode} phases (median ms): "
              + ", ".join(f"{name} {ms:.1f}" for name, ms in spent.items()))
    for problem in report["problems"]:
        print(f"problem: {problem}")
    for name, lines in report["daemon_log"].items():
        print(f"daemon {name} logged:")
        for line in lines:
            print(f"  {line}")


def run_group(index: int, plan: GroupPlan, state, results: Results, rounds: int,
              log_dir: str, work_dir: str, warm_bytes: int, daemon_problems: dict,
              store_url: str = "") -> None:
    """Runs one group's rounds: its daemons started, set up, measured, stopped; its shared
    memory and files freed whatever happens (with ``store_url``, its durable tier there)."""
    entry = {"modes": list(plan.modes), "footprint_states": plan.footprint(), "daemons": {}}
    results.groups.append(entry)
    common.trim_memory()
    reset_peak_rss()
    results.group_peak = 0
    group_dir = os.path.join(work_dir, f"group-{index + 1}")
    os.mkdir(group_dir)
    store_dir = f"{store_url}/group-{index + 1}" if store_url else ""
    daemons = Daemons(log_dir, f"{index + 1}")
    watchdog = Watchdog(daemons)
    bench = None
    try:
        bench = Bench(plan, state, results, daemons, group_dir, warm_bytes, store_dir)
        results.seconds.update(common.measure(bench, plan.modes, rounds))
        entry["daemons"].update(daemons.memory())
    except Exception as err:
        if watchdog.reason:
            raise RuntimeError(f"watchdog: {watchdog.reason} (then {err})") from err
        daemons.log_stacks()
        raise
    finally:
        watchdog.close()
        if bench is not None:
            bench.close()
        for name, taken in daemons.warm_taken.items():
            results.warm_taken[name] = results.warm_taken.get(name, 0) + taken
        daemons.stop_all()
        daemon_problems.update(daemons.problems())
        shutil.rmtree(group_dir, ignore_errors=True)
        if store_dir:
            from bubblesnap.service.durable import storage

            storage.at(store_dir).remove(store_dir)
        del bench
        common.trim_memory()
        entry["client_peak_rss_bytes"] = max(results.group_peak, common.proc_bytes("self", "VmHWM"))


#: The restores the huge-page comparison runs on daemons in /dev/shm and on --huge-dir.
HUGE_BASE = ("restore_local", "restore_local_resharded", "restore_peer")
#: Its modes, interleaved: each of HUGE_BASE, then each on huge pages (``*_huge``), and
#: Orbax's restore of the same state, which the local restores are held against.
HUGE_MODES = (*HUGE_BASE, *(f"{mode}_huge" for mode in HUGE_BASE), "orbax_restore")


class HugePair:
    """The HUGE_BASE restores on two sets of daemons: in /dev/shm and in a tmpfs mounted
    with huge pages (--huge-dir); ``*_huge`` the latter. Orbax's restore runs on the
    former's checkpoint (Orbax reads its files; the page size of a mapping is not its)."""

    def __init__(self, plain: "Bench", huge: "Bench"):
        for mode in HUGE_BASE:
            setattr(self, mode, getattr(plain, mode))
            setattr(self, f"{mode}_huge", getattr(huge, mode))
        self.orbax_restore = plain.orbax_restore


def run_huge(state, huge_dir: str, rounds: int, log_dir: str, work_dir: str,
             warm_bytes: int, daemon_problems: dict) -> dict:
    """The HUGE_BASE restores with plain and huge-page segments, interleaved: the report's
    "huge_pages"."""
    from bubblesnap.service.store import pages
    found = pages.detect(huge_dir)
    if not found.huge_pages:
        raise RuntimeError(f"--huge-dir {huge_dir} gives segments {found.describe()}: mount a "
                           "tmpfs with huge=within_size there (see the README)")
    plans = {"plain": GroupPlan((*HUGE_BASE, "orbax_restore")), "huge": GroupPlan(HUGE_BASE)}
    sides = {"plain": (Results(), Daemons(log_dir, "plain-")),
             "huge": (Results(), Daemons(log_dir, "huge-", shm_parent=huge_dir))}
    benches, watchdogs = {}, [Watchdog(d) for _, d in sides.values()]
    common.trim_memory()
    try:
        for side, (results, daemons) in sides.items():
            results.groups.append({"modes": list(plans[side].modes), "daemons": {}})
            folder = os.path.join(work_dir, f"huge-{side}")
            os.mkdir(folder)
            benches[side] = Bench(plans[side], state, results, daemons, folder, warm_bytes)
        seconds = common.measure(HugePair(benches["plain"], benches["huge"]), HUGE_MODES,
                                 rounds)
        memory = {side: daemons.memory() for side, (_, daemons) in sides.items()}
        shown = {side: benches[side].a.ready["shm_pages"] for side in sides}
    except Exception:
        for _, daemons in sides.values():
            daemons.log_stacks()
        raise
    finally:
        for watchdog in watchdogs:
            watchdog.close()
        for bench in benches.values():
            bench.close()
        for _, daemons in sides.values():
            daemons.stop_all()
            daemon_problems.update(daemons.problems())
    modes, med = common.bandwidths(seconds, lambda mode: benches["plain"].state_bytes)
    (plain, _), (huge, _) = sides["plain"], sides["huge"]
    rename = {mode: f"{mode}_huge" for mode in HUGE_BASE}

    def both(on_plain: dict, on_huge: dict) -> dict:
        """Per mode figures of both sides, the huge side's modes named ``*_huge``."""
        return {**on_plain, **{rename[m]: v for m, v in on_huge.items()}}

    return {
        "dir": huge_dir, "pages": shown, "modes": modes,
        "ratios": {**{f"{mode}_huge_vs_plain": round(med[f"{mode}_huge"] / med[mode], 3)
                      for mode in HUGE_BASE},
                   **{f"resharded_vs_same_local{tail}": round(
                       med[f"restore_local_resharded{tail}"] / med[f"restore_local{tail}"], 3)
                      for tail in ("", "_huge")},
                   **{f"restore_local{tail}_vs_orbax": round(
                       med[f"restore_local{tail}"] / med["orbax_restore"], 3)
                      for tail in ("", "_huge")}},
        "phases": both(*(common.phase_medians({m: r[1:] or r for m, r in side.phases.items()
                                               if r}) for side in (plain, huge))),
        "cpu": both(cpu_report(plain.cpu), cpu_report(huge.cpu)),
        "client_pmd_mapped_bytes": both(plain.pmd_mapped, huge.pmd_mapped),
        "matches": {**{m: plain.matches[m] for m in (*rename, "orbax_restore")},
                    **{rename[m]: huge.matches[m] for m in rename}},
        "daemons": memory, "problems": plain.problems + huge.problems,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=256, help="state size in MB (default 256)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--warm-pool-mb", type=float, default=None,
                        help="--warm-pool-bytes in MB of the daemons a restore lands in, per "
                             "segment one restore lands in at once (default: one state's "
                             "segment; 0: none)")
    parser.add_argument("--layout", choices=LAYOUTS, default="auto",
                        help="which modes run together: every mode at once, the groups of "
                             "SPLIT_GROUPS one after the other, or (auto, the default) those "
                             "merged while they fit the memory available")
    parser.add_argument("--huge-dir", metavar="DIR",
                        help="also compare restore_local and restore_peer with the daemons' "
                             "segments in DIR (a tmpfs mounted with huge=within_size) against "
                             "/dev/shm, interleaved: the report's huge_pages")
    parser.add_argument("--huge-only", action="store_true",
                        help="with --huge-dir: that comparison alone")
    parser.add_argument("--modes", type=lambda text: text.split(","), default=None,
                        help="the modes to run, comma-separated (default: every one; with "
                        "an object store: restore_durable, and orbax_restore on gs://)")
    durable_store.add_arguments(parser, "the durable tier there, restore_durable read from "
                                "it; on gs:// Orbax's checkpoint too (orbax_restore)")
    # --quick runs the split groups: the path large states take, every group set up
    args = common.parse_args(parser, quick={"mb": 8, "rounds": 1, "layout": "split"})
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.huge_only and not args.huge_dir:
        parser.error("--huge-only needs --huge-dir")
    if args.store and args.durable_url:
        parser.error("give --store or --durable-url, not both")
    on_store = bool(args.store or args.durable_url)
    on_gcs = args.store == "gcs" or args.durable_url.startswith("gs://")
    modes = tuple(args.modes or (MODES if not on_store else (
        "restore_durable", *(("orbax_restore",) if on_gcs else ()))))
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    common.force_cpu_devices(DEVICES)
    common.exit_on_sigterm()
    import jax
    jax.devices()  # the runtime's own memory, before the state: the baseline
    baseline = common.proc_bytes("self", "VmRSS")
    state = common.make_state(int(args.mb * 1e6), DEVICES)
    state_bytes = sum(s.nbytes for s in common.shard_bytes(state).values())
    unit = state_bytes + (4 << 20)
    warm = int(args.warm_pool_mb * 1e6) if args.warm_pool_mb is not None else unit
    available = mem_available()
    # The state is made already: counted in a group's footprint, gone from MemAvailable
    room = (available - _RESERVE) / unit + 1
    cap = _SHARE * room
    groups = make_groups(args.layout, cap, modes)
    common.log(f"state: {state_bytes / 1e6:.0f} MB; {available / 1e9:.1f} GB available: "
               f"room for {room:.1f} states, groups merged up to {cap:.1f}; layout "
               f"{args.layout}: {len(groups)} group(s)")
    too_big = [g for g in groups if g.footprint() > room]
    if too_big:
        error = (f"group {', '.join(too_big[0].modes)} needs about "
                 f"{too_big[0].footprint() * unit / 1e9:.1f} GB; the machine has room for "
                 f"{room * unit / 1e9:.1f} GB (the state made, and the "
                 f"{available / 1e9:.1f} GB available beyond a {_RESERVE >> 30} GiB reserve)")
        common.log(error)
        if args.json:
            print(json.dumps({"benchmark": "restore", "error": error}))
        return 1
    # The reaper removes it if this process is killed before its finally runs.
    work_dir = reaped_tempdir("bubblesnap-bench-restore-", "/dev/shm")
    log_dir = reaped_tempdir("bubblesnap-bench-restore-logs-")
    results, daemon_problems, error, huge = Results(), {}, None, None
    storage = "tmpfs (/dev/shm): daemon segments, Orbax checkpoint, durable tier"
    try:
        with (durable_store.object_store(args.store, args.durable_url) if on_store
              else contextlib.nullcontext((None, None))) as (store_url, store):
            if store_url:
                there = "durable tier and Orbax checkpoint" if on_gcs else "durable tier"
                storage = f"{there} on {store}; daemon segments in tmpfs (/dev/shm)"
            for index, plan in enumerate([] if args.huge_only else groups):
                run_group(index, plan, state, results, args.rounds, log_dir, work_dir, warm,
                          daemon_problems, store_url or "")
        if args.huge_dir:
            huge = run_huge(state, args.huge_dir, args.rounds, log_dir, work_dir, warm,
                            daemon_problems)
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
        shutil.rmtree(log_dir, ignore_errors=True)
        for name, lines in daemon_problems.items():
            common.log(f"daemon {name} logged:\n  " + "\n  ".join(lines))
    if error is not None:
        common.log(f"the benchmark failed: {error}")
        if args.json:
            print(json.dumps({"benchmark": "restore", "error": error,
                              "problems": results.problems, "daemon_log": daemon_problems}))
        return 1
    if args.huge_only:
        report = {"benchmark": "restore", "state_bytes": state_bytes, "rounds": args.rounds,
                  "huge_pages": huge, "daemon_log": daemon_problems}
        common.report_out(report, args.json, lambda r: print(json.dumps(r, indent=1)))
        return 0
    memory = memory_report(results, state_bytes, baseline, args.layout, available, cap)
    report = summarize(results, state_bytes, args.rounds, daemon_problems, memory, storage)
    report["warm_pool"] = {"bytes": warm, "segments_taken": results.warm_taken}
    if huge is not None:
        report["huge_pages"] = huge
    common.report_out(report, args.json, print_restore_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
