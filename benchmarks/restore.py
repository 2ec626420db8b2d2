"""Restore bandwidth by tier and by topology, against TCP and Orbax.

One state pytree (default ~256 MB: bfloat16 params with float32 Adam moments,
12 leaves, rows sharded over 4 forced CPU devices, as in datapath.py) is
snapshotted once, as rank 0 of a one-rank job, and restored through every
tier; the same state is also snapshotted as step 1 of a second job of 2
ranks, each copying half the rows of every array (job-wide), written over raw
gRPC as two processes of a 2-process job would (no jax.distributed needed).
Restores by regions: the client asks for the regions its target shardings
put on its devices. Into the snapshot's own layout one copy holds them box
for box and is handed over as it is; otherwise the daemon reads the shards
that meet them (from every rank's copy) and assembles a fresh segment. Each
mode reports bytes/s (GB/s, 1e9 bytes/s):

  raw_tcp          loopback TCP in this run: a sender thread os.sendfile()s a
                   /dev/shm file of the segment's size over a new 127.0.0.1
                   connection; this thread recv_into()s a buffer allocated and
                   touched before. The physical limit of one stream.
  raw_tcp_parallel the same over data_channel.PULL_STREAMS connections at once,
                   each carrying an equal range (as the peer path does).
  peer_transfer    the peer data path alone: OpenRead on daemon A's Peer
                   service (a one-time ticket), then the daemon's own puller:
                   ranged pulls over parallel connections into a buffer
                   touched before, each slot hashed as its bytes land.
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

Daemons (separate processes, default --nice, as a trainer's host would run
them): a ring A, B, C, E (--peers, indices 0..3, --replicas 1, so A and B
hold every copy, C and E none); A also writes
every step to the durable tier (--durable-dir DIR --durable-every-steps 1);
D is alone with the same DIR. This process snapshots both jobs' step on A
and waits until B holds every rank's replica (2 copies) and DIR holds the
step of both jobs. After every same-topology restore on C or E,
DeleteSnapshots drops the copy it pulled, so the next round pulls again (A
and B keep 2 copies, so nothing is pushed back); an assembled restore (on C or D)
keeps no copy, only the segment handed over, so every round reads again.
The source every restore reports, and the step and world size it was taken
with, are checked each round. C forgets the copy but not the job, so only
the warm-up round restores on a daemon that had never seen it. A restore on
A into another world size than the step's (restore_local_2to1) resumes the
job as a new epoch: A drops later copies (none here) and calls Rollback at
B and C, inside the clock, as a real resume would once; here every round,
as the job never registers under its new world size.

Orbax's checkpoint and DIR are on /dev/shm (tmpfs) like the daemons'
segments, so no mode reads a disk. The machines are shared and noisy: modes
run interleaved, round after round (the first mode rotates each round),
after one untimed warm-up round; medians with min-max are reported, and
ratios of medians of the same run; per restoring mode, the median ms of each
phase a restore reports (the client's call, map and place, the daemon's own
as daemon.<name>: holdings, segment, open, receive, verify, land, ...; and
"ready", until jax.block_until_ready returns). Before each mode the process
collects its garbage (a restore's arrays freed inside the next mode's clock
would free their pages there) and hands its free heap back to the OS (glibc
malloc_trim), as datapath.py does. Every restore (and every pulled segment,
every TCP transfer) is compared bit for bit with the original, outside the
timed region.

Targets: peer_transfer >= 0.5 x raw TCP (the faster of raw_tcp and
raw_tcp_parallel); restore_peer >= 5 x orbax_restore; restores into another
partition spec or from another process count at least half as fast as the
same-topology restore from the same tier (reported, never failed on).

The daemons log at WARNING to files; the report carries the first lines of
each under "daemon_log" (a ring's daemons start one after another, so
"peer N is unreachable" at start-up is expected). A daemon that leaks
segments could fill /dev/shm and wake the OOM killer, so a watchdog thread
stops every daemon as soon as one holds more than its memory budget in its
shared-memory directory or /dev/shm has less than 2 GiB free, and setup
gives up as soon as A logs a replication that a peer did not take. Whatever
happens, every daemon gets SIGTERM and the work files are removed; on a
failure --json prints {"error": ..., "daemon_log": ...} and the exit code is 1.

Every daemon keeps --warm-pool-mb (default twice the state) of pre-faulted
segments ready (--warm-pool-bytes), on top of its budget for the copies, so
what a restore lands in is faulted in already, as on a host sized for it.

Usage: python benchmarks/restore.py [--json] [--quick] [--mb 256] [--rounds 5]
       [--warm-pool-mb MB]
"""

import argparse
import itertools
import json
import mmap
import os
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
import urllib.request

import bench_common as common
import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.protos import peer_pb2_grpc
from bubblesnap.protos.checksum import checksum
from bubblesnap.service.peers import data_channel
from bubblesnap.service.store.layout import build_layout
from bubblesnap.sockets import recv_exact
from bubblesnap.testing import DaemonProcess, free_port, wait_for

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
DEVICES = 4
JOB = "bench-restore"
#: The same state, snapshotted by the two ranks of another job, each copying half the rows.
JOB_2RANKS = "bench-restore-2ranks"
STEP = 1
_READY_SECONDS = 120.0
_WAIT_SECONDS = 300.0
#: Below this much free /dev/shm the watchdog stops the daemons.
_SHM_FLOOR = 2 << 30

class Daemons:
    """Starts daemons and stops every one of them in :meth:`stop_all`."""

    def __init__(self, budget_bytes: int, log_dir: str, warm_pool_bytes: int = 0):
        self.budget = str(budget_bytes)
        self.warm = str(warm_pool_bytes)
        self.log_dir = log_dir
        self.started: dict[str, DaemonProcess] = {}

    def start(self, name: str, *flags: str) -> DaemonProcess:
        daemon = DaemonProcess("--memory-budget", self.budget, "--warm-pool-bytes", self.warm,
                               *flags, name=f"daemon {name}", metrics="127.0.0.1:0",
                               stderr=os.path.join(self.log_dir, f"daemon-{name}.log"),
                               ready_timeout=_READY_SECONDS)
        self.started[name] = daemon
        return daemon

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
        limit = int(self.budget) + (64 << 20)
        for daemon in list(self.started.values()):  # the watchdog's thread: copy first
            directory = daemon.ready.get("shm_dir")
            if not directory:
                continue
            try:
                held = sum(e.stat().st_size for e in os.scandir(directory) if e.is_file())
            except OSError:
                continue
            if held > limit:
                return (f"{daemon.name} holds {held / 1e6:.0f} MB in {directory}, over its "
                        f"{int(self.budget) / 1e6:.0f} MB memory budget: it leaks segments")
        stat = os.statvfs("/dev/shm")
        if stat.f_bavail * stat.f_frsize < _SHM_FLOOR:
            return f"/dev/shm has less than {_SHM_FLOOR >> 30} GiB free"
        return None

    def problems(self) -> dict[str, list[str]]:
        """WARNING/ERROR lines each daemon logged (at most 20), and unclean exits."""
        found = {}
        for name, daemon in self.started.items():
            lines = [line.rstrip() for line in daemon.stderr_text().splitlines() if line.strip()]
            if daemon.exit_code not in (0, None):
                lines.append(f"exited with code {daemon.exit_code}")
            if lines:
                found[name] = lines[:20]
        return found


class Watchdog:
    """Stops every daemon as soon as :meth:`Daemons.overrun` says the machine is at risk."""

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

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


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
    """``state`` sharded by columns instead of rows, over the same devices (a copy)."""
    import jax
    return jax.tree.map(lambda x: jax.device_put(x, jax.sharding.NamedSharding(
        x.sharding.mesh, jax.sharding.PartitionSpec(None, "x"))), state)


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


class Bench:
    """The state, the daemons, clients and checkpointer, and one timing function per mode."""

    def __init__(self, state, daemons: Daemons, shm_dir: str):
        self.state = state
        self.target = common.restore_target(state)
        # Columns instead of rows: every device's region cuts across every row shard held.
        self.resharded = by_columns(state)
        self.resharded_target = common.restore_target(self.resharded)
        self.shards = common.shard_bytes(state)
        self.state_bytes = sum(s.nbytes for s in self.shards.values())
        self.matches = {mode: True for mode in MODES}
        self.sources: dict[str, list[str]] = {mode: [] for mode in EXPECTED_SOURCE}
        #: per restoring mode, each round's phases (Restored.phases, and "ready")
        self.phases: dict[str, list[dict[str, float]]] = {mode: [] for mode in EXPECTED_SOURCE}
        #: per whole-copy peer restore, each round's MB sent by A's and B's data channels
        self.holder_mb: dict[str, list[list[float]]] = {"restore_peer": [],
                                                        "restore_peer_2holders": []}
        self.settle_timeouts = 0  # rounds whose warm pool was not full again within 10 s
        self.problems: list[str] = []
        self._closers = []
        try:
            self._setup(daemons, shm_dir)
        except BaseException:
            self.close()
            raise

    def _setup(self, daemons: Daemons, shm_dir: str) -> None:
        import orbax.checkpoint as ocp

        from bubblesnap.clients.jax import ClientOptions, SnapshotClient
        state = self.state
        durable_dir = os.path.join(shm_dir, "durable")
        peers = ",".join(f"127.0.0.1:{free_port()}" for _ in range(4))
        ring = ("--peers", peers, "--replicas", "1")
        common.log("starting daemons A, B, C, E (a ring, --replicas 1; A writes the durable "
                   "tier; C pulls from one holder) and D")
        self.a = daemons.start("A", *ring, "--index", "0", "--durable-dir", durable_dir,
                               "--durable-every-steps", "1")
        self.b = daemons.start("B", *ring, "--index", "1")
        self.c = daemons.start("C", *ring, "--index", "2", "--no-spread-restores")
        self.e = daemons.start("E", *ring, "--index", "3")
        self.d = daemons.start("D", "--durable-dir", durable_dir, "--durable-every-steps", "1")

        def client(daemon, job=JOB):
            made = SnapshotClient(job, options=ClientOptions(daemon=daemon.address,
                                                             restore_timeout_seconds=120))
            self._closers.append(made.close)
            return made

        self.trainer, self.peer_client, self.durable_client = client(self.a), client(self.c), \
            client(self.d)
        self.spread_client = client(self.e)
        # This one process (rank 0 of 1) restores the 2-rank job's step.
        self.wide_local, self.wide_peer = client(self.a, JOB_2RANKS), client(self.c, JOB_2RANKS)
        common.log(f"snapshotting step {STEP} of rank 0 on A")
        result = self.trainer.snapshot(STEP, state, wait=True)
        if result is None or not result.taken:
            raise RuntimeError(f"the snapshot was not taken: {getattr(result, 'reason', '')}")
        common.log(f"snapshotting step {STEP} of the 2 ranks of {JOB_2RANKS} on A, each "
                   "copying half the rows")
        for rank in range(2):
            self._snapshot_half(rank)
        for job, ranks in ((JOB, (0,)), (JOB_2RANKS, (0, 1))):
            for rank in ranks:
                wait_for(lambda job=job, rank=rank: self._copies(self.a, job, rank) == 2,
                         f"step {STEP} of rank {rank} of {job} held twice (A and B)",
                         _WAIT_SECONDS,
                         failed=lambda: "; ".join(daemons.logged(self.a, "did not take")[:1]))
            # A writes every step of both jobs: wait, so no write runs under the clock
            wait_for(lambda job=job: STEP in self._status(self.a, job).durable_steps,
                     f"A to write step {STEP} of {job} to the durable tier", _WAIT_SECONDS)
        wait_for(lambda: self.b.stub.Status(pb.StatusRequest(job=JOB), timeout=10).jobs,
                 "B to hold the replica", _WAIT_SECONDS)
        common.log("A and B hold both jobs' step, the durable tier has it")

        self._peer_channel = grpc.insecure_channel(self.a.ready["peer_address"])
        self._closers.append(self._peer_channel.close)
        self.peer_stub = peer_pb2_grpc.PeerStub(self._peer_channel)
        opened = self._open_read()
        self.segment_bytes = opened.segment_bytes
        self.pull_buffer = np.empty(self.segment_bytes, np.uint8)
        self.pull_buffer.fill(0)
        self._pull(opened)
        if not self._segment_matches(opened):
            raise RuntimeError("the segment pulled from A does not hold the state")

        # The raw TCP file holds the segment's bytes, so both transfers move the same data.
        self.raw_path = os.path.join(shm_dir, "raw-tcp-source")
        self.pull_buffer.tofile(self.raw_path)
        self.raw_source = np.fromfile(self.raw_path, np.uint8)
        self.raw_buffer = np.empty(self.segment_bytes, np.uint8)
        self.raw_buffer.fill(0)
        self.sender = RawSender(self.raw_path, self.segment_bytes)
        self._closers.append(self.sender.close)

        self.checkpointer = ocp.StandardCheckpointer()
        self._closers.append(self.checkpointer.close)
        self.orbax_path = os.path.join(shm_dir, "orbax")
        common.log(f"saving the state with Orbax to {self.orbax_path}")
        self.checkpointer.save(self.orbax_path, state)
        self.checkpointer.wait_until_finished()

    def close(self) -> None:
        for close in reversed(self._closers):
            try:
                close()
            except Exception as err:
                common.log(f"closing failed: {err!r}")

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
        stub.CommitStep(pb.CommitStepRequest(job=JOB_2RANKS, rank=rank, step=STEP), timeout=60)

    def _open_read(self):
        return self.peer_stub.OpenRead(ppb.OpenReadRequest(job=JOB, rank=0, step=STEP),
                                       timeout=30)

    def _segment_matches(self, opened) -> bool:
        """Every slot of the pulled segment matches its checksum and the original shard."""
        from bubblesnap.service.store import layout as layout_lib
        layout = layout_lib.build_layout(opened.tensors)
        slots = layout.slots()
        if len(slots) != len(self.shards) or len(opened.checksums) != len(slots):
            return False
        for (t, s, offset, nbytes), expected in zip(slots, opened.checksums, strict=True):
            tensor = layout.tensors[t]
            data = self.pull_buffer[offset:offset + nbytes]
            original = self.shards.get((tensor.name, tensor.shards[s].index))
            if checksum(data) != expected or original is None or \
                    not np.array_equal(data, original):
                return False
        return True

    def _check(self, mode: str, restored, expected, world_size: int = 1) -> None:
        """Outside the clock: the source, the step (and the world size it was taken with)
        and the bytes of a restore, against the state ``expected``."""
        if mode in EXPECTED_SOURCE:
            self.sources[mode].append(restored.source)
            if restored.source != EXPECTED_SOURCE[mode]:
                self.problems.append(f"{mode}: restored from {restored.source!r}, expected "
                                     f"{EXPECTED_SOURCE[mode]!r}")
            if (restored.step, restored.world_size) != (STEP, world_size):
                self.problems.append(f"{mode}: restored step {restored.step} of "
                                     f"{restored.world_size} ranks, not {STEP} of {world_size}")
                self.matches[mode] = False
            restored = restored.state
        if not common.same_state(expected, restored):
            self.matches[mode] = False
            self.problems.append(f"{mode}: the restored state differs from the original")

    def _delete_copy(self, daemon, mode: str) -> None:
        try:
            daemon.stub.DeleteSnapshots(pb.DeleteSnapshotsRequest(job=JOB, steps=[STEP]),
                                        timeout=30)
        except grpc.RpcError as err:
            self.problems.append(f"{mode}: DeleteSnapshots on {daemon.name} failed: "
                                 f"{err.code().name}: {err.details()}")

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
                view, got = memoryview(self.raw_buffer), start
                while got < stop:
                    n = conn.recv_into(view[got:stop])
                    if n == 0:
                        raise ConnectionError(f"raw TCP sender closed after {got} bytes "
                                              f"({self.sender.error})")
                    got += n
                del view

        started = time.perf_counter()
        threads = [threading.Thread(target=receive, args=(a, b))
                   for a, b in itertools.pairwise(bounds[1:])]
        for t in threads:
            t.start()
        receive(bounds[0], bounds[1])
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - started
        if not np.array_equal(self.raw_buffer, self.raw_source):
            self.matches["raw_tcp"] = False
            self.problems.append("raw_tcp: the received bytes differ from the file")
        self.raw_buffer[:1] = 0  # the next round must write it again to match
        return elapsed

    def _pull(self, opened) -> None:
        """The daemon's own peer data path: parallel ranged pulls, slots hashed as they land."""
        slots = [(o, n) for _, _, o, n in build_layout(opened.tensors).slots()]
        fill = data_channel.puller(opened.data_address, opened.ticket, None, 60, "the segment")
        digests = fill(self.pull_buffer[:opened.segment_bytes], slots)
        if tuple(digests) != tuple(opened.checksums):
            self.problems.append("peer_transfer: checksums of the pulled slots differ")

    def peer_transfer(self) -> float:
        started = time.perf_counter()
        opened = self._open_read()
        self._pull(opened)
        elapsed = time.perf_counter() - started
        if opened.segment_bytes != self.segment_bytes or not self._segment_matches(opened):
            self.matches["peer_transfer"] = False
            self.problems.append("peer_transfer: the pulled segment differs from the state")
        self.pull_buffer[:1] = 0
        return elapsed

    def restore_local(self) -> float:
        return self._restore("restore_local", self.trainer)

    def restore_local_resharded(self) -> float:
        return self._restore("restore_local_resharded", self.trainer, resharded=True)

    def restore_local_2to1(self) -> float:
        return self._restore("restore_local_2to1", self.wide_local, world_size=2)

    # A daemon keeps no copy of what it assembles (only the segment handed over), so only
    # the same-topology restore on C, which installs the copy it pulls, needs it dropped
    # for the next round to pull again.
    def restore_peer(self) -> float:
        return self._restore_whole_copy("restore_peer", self.peer_client, self.c, "A")

    def restore_peer_2holders(self) -> float:
        return self._restore_whole_copy("restore_peer_2holders", self.spread_client, self.e,
                                        "AB")

    def _restore_whole_copy(self, mode: str, client, daemon, senders: str) -> float:
        """A restore that pulls the whole copy; ``senders``: which of A and B must have sent
        bytes of it (outside the clock, from their metrics)."""
        before = [_sent_bytes(d) for d in (self.a, self.b)]
        elapsed = self._restore(mode, client)
        sent = [_sent_bytes(d) - b for d, b in zip((self.a, self.b), before, strict=True)]
        self.holder_mb[mode].append([round(n / 1e6, 1) for n in sent])
        if "".join(name for name, n in zip("AB", sent, strict=True) if n > 0) != senders:
            self.problems.append(f"{mode}: A and B sent {sent} bytes; expected bytes from "
                                 f"{' and '.join(senders)} only")
        self._delete_copy(daemon, mode)
        self._settle(daemon)
        return elapsed

    def _settle(self, daemon) -> None:
        """Waits (up to 10 s) for ``daemon``'s warm pool to be full again: refilling it
        pre-faults a state's worth of pages, which must not run inside the next
        mode's clock (the modes keep their neighbours as the order rotates)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            memory = daemon.stub.Status(pb.StatusRequest(), timeout=10).memory
            if memory.warm_bytes >= memory.warm_pool_bytes:
                return
            time.sleep(0.02)
        self.settle_timeouts += 1

    def restore_peer_resharded(self) -> float:
        return self._restore("restore_peer_resharded", self.peer_client, resharded=True)

    def restore_peer_2to1(self) -> float:
        return self._restore("restore_peer_2to1", self.wide_peer, world_size=2)

    def restore_durable(self) -> float:
        return self._restore("restore_durable", self.durable_client)

    def _restore(self, mode: str, client, resharded: bool = False, world_size: int = 1) -> float:
        import jax
        target, expected = (self.resharded_target, self.resharded) if resharded else \
            (self.target, self.state)
        started = time.perf_counter()
        restored = client.restore(target)
        returned = time.perf_counter()
        jax.block_until_ready(restored.state)
        elapsed = time.perf_counter() - started
        self.phases[mode].append({**restored.phases, "ready": elapsed - (returned - started)})
        self._check(mode, restored, expected, world_size)
        return elapsed

    def orbax_restore(self) -> float:
        return self._orbax("orbax_restore", self.target, self.state)

    def orbax_restore_resharded(self) -> float:
        return self._orbax("orbax_restore_resharded", self.resharded_target, self.resharded)

    def _orbax(self, mode: str, target, expected) -> float:
        import jax
        started = time.perf_counter()
        restored = self.checkpointer.restore(self.orbax_path, target)
        jax.block_until_ready(restored)
        elapsed = time.perf_counter() - started
        self._check(mode, restored, expected)
        return elapsed


def _sent_bytes(daemon) -> float:
    """What ``daemon``'s data channel sent so far (bubblesnap_data_sent_bytes_total)."""
    text = urllib.request.urlopen(f"http://{daemon.ready['metrics']}/metrics",
                                  timeout=10).read().decode()
    return next(s.value for family in text_string_to_metric_families(text)
                for s in family.samples if s.name == "bubblesnap_data_sent_bytes_total")


def summarize(seconds: dict[str, list[float]], bench: Bench, rounds: int,
              daemon_problems: dict) -> dict:
    modes, med = common.bandwidths(seconds, lambda mode: bench.segment_bytes if mode in (
        "raw_tcp", "raw_tcp_parallel", "peer_transfer") else bench.state_bytes)
    ratios = {
        # against the faster of one stream and as many streams as the peer path uses
        "peer_transfer_vs_raw_tcp": med["peer_transfer"] / max(med["raw_tcp"],
                                                               med["raw_tcp_parallel"]),
        "restore_peer_vs_orbax": med["restore_peer"] / med["orbax_restore"],
        "restore_peer_vs_peer_transfer": med["restore_peer"] / med["peer_transfer"],
        # issue 13's goal: a peer restore end to end at the wire's speed
        "restore_peer_vs_raw_tcp_parallel": med["restore_peer"] / med["raw_tcp_parallel"],
        # the same from both holders at once
        "restore_peer_2holders_vs_raw_tcp_parallel": med["restore_peer_2holders"]
        / med["raw_tcp_parallel"],
        "restore_peer_2holders_vs_restore_peer": med["restore_peer_2holders"]
        / med["restore_peer"],
        "restore_local_vs_orbax": med["restore_local"] / med["orbax_restore"],
        "restore_durable_vs_orbax": med["restore_durable"] / med["orbax_restore"],
        # another partition spec and another process count, against the same topology
        "resharded_vs_same_local": med["restore_local_resharded"] / med["restore_local"],
        "resharded_vs_same_peer": med["restore_peer_resharded"] / med["restore_peer"],
        "2to1_vs_same_local": med["restore_local_2to1"] / med["restore_local"],
        "2to1_vs_same_peer": med["restore_peer_2to1"] / med["restore_peer"],
        # each against Orbax restoring into the same target shardings
        "restore_local_resharded_vs_orbax": med["restore_local_resharded"]
        / med["orbax_restore_resharded"],
        "restore_peer_resharded_vs_orbax": med["restore_peer_resharded"]
        / med["orbax_restore_resharded"],
        "restore_local_2to1_vs_orbax": med["restore_local_2to1"] / med["orbax_restore"],
        "restore_peer_2to1_vs_orbax": med["restore_peer_2to1"] / med["orbax_restore"],
    }
    return {
        "benchmark": "restore", "state_bytes": bench.state_bytes,
        "segment_bytes": bench.segment_bytes, "leaves": common.STATE_LEAVES,
        "devices": DEVICES, "rounds": rounds, "modes": modes,
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "meets_targets": {
            "peer_transfer_ge_50pct_raw_tcp": ratios["peer_transfer_vs_raw_tcp"] >= 0.5,
            "restore_peer_ge_5x_orbax_restore": ratios["restore_peer_vs_orbax"] >= 5,
            # the goal: another spec or process count at least half as fast
            "resharded_local_ge_50pct_same": ratios["resharded_vs_same_local"] >= 0.5,
            "resharded_peer_ge_50pct_same": ratios["resharded_vs_same_peer"] >= 0.5,
            "2to1_local_ge_50pct_same": ratios["2to1_vs_same_local"] >= 0.5,
            "2to1_peer_ge_50pct_same": ratios["2to1_vs_same_peer"] >= 0.5,
            # issue 13's goals (reported, never failed on)
            "restore_peer_ge_80pct_raw_tcp_parallel":
                ratios["restore_peer_vs_raw_tcp_parallel"] >= 0.8,
            "restore_durable_ge_orbax": ratios["restore_durable_vs_orbax"] >= 1.0,
            "restore_local_ge_20x_orbax": ratios["restore_local_vs_orbax"] >= 20,
        },
        # the timed rounds' (the first is the warm-up's)
        "phases": common.phase_medians({m: r[1:] or r for m, r in bench.phases.items()}),
        "matches": bench.matches,
        "sources": bench.sources,
        "holder_mb": bench.holder_mb,
        "warm_pool_not_refilled": bench.settle_timeouts,
        "storage": "tmpfs (/dev/shm): daemon segments, raw TCP file, Orbax checkpoint, "
                   "durable tier",
        "problems": bench.problems,
        "daemon_log": daemon_problems,
    }


def print_restore_table(report: dict) -> None:
    common.print_table(report, f"state: {report['state_bytes'] / 1e6:.0f} MB in "
                               f"{report['leaves']} leaves on {report['devices']} CPU devices, "
                               f"{report['rounds']} interleaved rounds", report["matches"])
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=256, help="state size in MB (default 256)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--warm-pool-mb", type=float, default=None,
                        help="every daemon's --warm-pool-bytes in MB (default: twice the "
                             "state; 0: none, as before issue 13)")
    args = common.parse_args(parser, quick={"mb": 8, "rounds": 1})
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    common.force_cpu_devices(DEVICES)
    common.exit_on_sigterm()
    state = common.make_state(int(args.mb * 1e6), DEVICES)
    shm_dir = tempfile.mkdtemp(dir="/dev/shm", prefix="bubblesnap-bench-restore-")
    log_dir = tempfile.mkdtemp(prefix="bubblesnap-bench-restore-logs-")
    state_bytes = sum(s.nbytes for s in common.shard_bytes(state).values())
    common.log(f"state: {state_bytes / 1e6:.0f} MB; work files in {shm_dir}")
    # Room for what a restore lands in (a pulled copy, an assembled segment), pre-faulted
    warm = int(args.warm_pool_mb * 1e6) if args.warm_pool_mb is not None else 2 * state_bytes
    # A holds both jobs' copies and a segment assembled for each job's last restore
    daemons = Daemons(6 * state_bytes + warm + (64 << 20), log_dir, warm)
    watchdog = Watchdog(daemons)
    bench = seconds = error = warm_taken = None
    try:
        bench = Bench(state, daemons, shm_dir)
        seconds = common.measure(bench, MODES, args.rounds)
        warm_taken = {name: daemon.stub.Status(pb.StatusRequest(), timeout=10)
                      .memory.warm_segments_taken for name, daemon in daemons.started.items()}
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
        if watchdog.reason:
            error = f"watchdog: {watchdog.reason} (then {error})"
        traceback.print_exc()
    finally:
        watchdog.close()
        if bench is not None:
            bench.close()
        daemons.stop_all()
        shutil.rmtree(shm_dir, ignore_errors=True)
        daemon_problems = daemons.problems()
        shutil.rmtree(log_dir, ignore_errors=True)
        for name, lines in daemon_problems.items():
            common.log(f"daemon {name} logged:\n  " + "\n  ".join(lines))
    if error is not None:
        common.log(f"the benchmark failed: {error}")
        if args.json:
            print(json.dumps({"benchmark": "restore", "error": error,
                              "problems": bench.problems if bench else [],
                              "daemon_log": daemon_problems}))
        return 1
    report = summarize(seconds, bench, args.rounds, daemon_problems)
    report["warm_pool"] = {"bytes": warm, "segments_taken": warm_taken}
    common.report_out(report, args.json, print_restore_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
