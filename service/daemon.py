"""One daemon: its options, and the wiring of its parts (build from options, start, stop)."""

import dataclasses
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
from concurrent import futures

import grpc

from bubblesnap.protos import daemon_pb2, peer_pb2
from bubblesnap.service.bubbles import BubbleOptions, BubblePlans
from bubblesnap.service.coordination.etcd_group import EtcdGroup
from bubblesnap.service.durable import DurableOptions, DurableReader, DurableWriter
from bubblesnap.service.errors import DaemonError
from bubblesnap.service.heartbeat import Heartbeat
from bubblesnap.service.logs import LogOptions, TrainingLogs
from bubblesnap.service.metrics import DaemonMetrics
from bubblesnap.service.peers.data_server import DataServer
from bubblesnap.service.peers.group import PeerGroup
from bubblesnap.service.peers.group_name import GroupNameInterceptor
from bubblesnap.service.peers.idle_windows import IdleWindows
from bubblesnap.service.peers.layouts import GroupLayouts
from bubblesnap.service.peers.log_replication import LogReplication
from bubblesnap.service.peers.peer_options import PeerOptions
from bubblesnap.service.peers.replicator import Replicator
from bubblesnap.service.peers.security import TokenInterceptor
from bubblesnap.service.peers.transfers import Transfers
from bubblesnap.service.progress import Progress
from bubblesnap.service.restore import Restorer
from bubblesnap.service.rpc import trainer
from bubblesnap.service.rpc.handlers import generic_handler
from bubblesnap.service.rpc.local_socket import SocketError
from bubblesnap.service.rpc.peer import PeerServicer
from bubblesnap.service.rpc.server import TrainerServer
from bubblesnap.service.rpc.trainer_token import TrainerToken
from bubblesnap.service.status import Status
from bubblesnap.service.store import SnapshotStore, StoreOptions, pages
from bubblesnap.service.store.segments import leftover_bytes, shm_free_bytes
from bubblesnap.shared.options import require
from bubblesnap.shared.trainer_api import DEFAULT_ADDRESS, TOKEN_ENV, socket_path

log = logging.getLogger("bubblesnap.daemon")

SERVICE_NAME = daemon_pb2.DESCRIPTOR.services_by_name["Daemon"].full_name
PEER_SERVICE = peer_pb2.DESCRIPTOR.services_by_name["Peer"]

#: Below this much free space the shm directory is treated as a container's
#: default /dev/shm (64 MiB in Docker) and the budget is capped with a warning.
_SHM_HEADROOM = 0.9


@dataclasses.dataclass(frozen=True, kw_only=True)
class DaemonOptions:
    """Everything ``bubblesnap daemon`` can be told (its flags in brackets).

    Attributes:
      listen: gRPC address for trainers and tools (``--listen``): a Unix
        socket ``unix:PATH``, made owner-only, or ``host:port`` (TCP, where
        any local user can connect: the calls that drop snapshots need
        ``trainer_token`` there). Default this user's socket,
        ``trainer_api.DEFAULT_ADDRESS``.
      trainer_token: the token a call over TCP must carry to drop snapshots
        (a Restore that is not ``alone``, DeleteSnapshots)
        (``--trainer-token-file``, or $BUBBLESNAP_TRAINER_TOKEN); empty: over
        TCP those calls are refused. Not needed on the Unix socket.
      metrics: ``host:port`` of the Prometheus endpoint; empty disables it
        (``--metrics``).
      shm_dir: tmpfs directory for snapshot segments (``--shm-dir``). Default
        /dev/shm.
      store: memory budget, retention and checksum options.
      bubbles: bubble profiling and planning options.
      max_message_bytes: largest gRPC message accepted or sent, on the
        trainer port and between peers (layouts of huge pytrees); larger
        ones get RESOURCE_EXHAUSTED (``--max-message``). Default 64 MiB.
      rpc_threads: threads doing the work of trainer calls (``--rpc-threads``);
        calls that may wait long (Restore, RestoreStream, WaitCommitted) have as
        many again of their own and Status two, so none waits behind the others. A
        Bubbles stream holds none between its messages. Default 16 (more
        threads mostly contend for the GIL and the store lock).
      max_streams: Bubbles streams open at once (one per pipeline stage);
        more are refused with RESOURCE_EXHAUSTED (``--max-streams``). Default
        4096.
      grace_seconds: how long SIGTERM lets in-flight RPCs finish. Default 5 s.
      nice: niceness added to the daemon's process so training processes win
        every contended core (``--nice``, 0..19). Default 10.
      peers: the ring of daemons this one replicates to. Default: alone.
      durable: the durable tier (Orbax checkpoints). Default: off.
      logs: limits of the training logs.
    """

    listen: str = DEFAULT_ADDRESS
    trainer_token: str = dataclasses.field(default="", repr=False)
    metrics: str = "127.0.0.1:7071"
    shm_dir: str = "/dev/shm"
    store: StoreOptions = StoreOptions()
    bubbles: BubbleOptions = BubbleOptions()
    max_message_bytes: int = 64 << 20
    rpc_threads: int = 16
    max_streams: int = 4096
    grace_seconds: float = 5.0
    nice: int = 10
    peers: PeerOptions = PeerOptions()
    durable: DurableOptions = DurableOptions()
    logs: LogOptions = LogOptions()

    def __post_init__(self):
        require(self, "max_message_bytes", self.max_message_bytes >= 1 << 20, "at least 1 MiB",
                "--max-message")
        require(self, "listen", not self.listen.startswith("unix-abstract:"),
                "a unix:PATH socket or host:port (an abstract socket has no owner-only mode)",
                "--listen")
        require(self, "rpc_threads", self.rpc_threads >= 1, "at least 1", "--rpc-threads")
        require(self, "max_streams", self.max_streams >= 1, "at least 1", "--max-streams")
        require(self, "grace_seconds", self.grace_seconds >= 0, ">= 0")
        require(self, "nice", 0 <= self.nice <= 19, "between 0 and 19", "--nice")


class DaemonStartError(RuntimeError):
    """The daemon cannot start as configured (a port taken, a directory missing, ...)."""


def _fit_budget_to_shm(options: DaemonOptions) -> StoreOptions:
    """Caps the memory budget to what the shm filesystem can hold, and says so. What
    killed daemons left there counts as free: it is adopted into the budget or dropped."""
    free = shm_free_bytes(options.shm_dir) + leftover_bytes(options.shm_dir)
    budget = options.store.memory_budget_bytes
    if budget <= free * _SHM_HEADROOM:
        return options.store
    capped = int(free * _SHM_HEADROOM)
    log.warning(
        "%s has only %.1f MiB free, less than the %.1f MiB memory budget; the budget is capped "
        "to %.1f MiB so writes fail cleanly instead of crashing the trainer with SIGBUS. In a "
        "container, raise its shared memory (docker run --shm-size=16g) or pass --shm-dir.",
        options.shm_dir, free / 2**20, budget / 2**20, capped / 2**20)
    return dataclasses.replace(options.store, memory_budget_bytes=max(1, capped))


def _server(threads: int, max_message_bytes: int, name: str, interceptors=()) -> grpc.Server:
    return grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name),
                       interceptors=interceptors,
                       options=[("grpc.max_receive_message_length", max_message_bytes),
                                ("grpc.max_send_message_length", max_message_bytes),
                                # a second daemon on a taken port must fail, not share it
                                ("grpc.so_reuseport", 0)])


def _bind(add_port, address: str, what: str) -> int:
    try:
        port = add_port(address)
    except SocketError as err:
        raise DaemonStartError(f"cannot listen {what} on {address}: {err}") from None
    except RuntimeError:
        port = 0
    if port == 0:
        raise DaemonStartError(f"cannot listen {what} on {address}: address in use or invalid")
    return port


class Daemon:
    """A running daemon; :meth:`stop` shuts it down and frees its shared memory.

    Raises DaemonStartError when it cannot start as configured.
    """

    def __init__(self, options: DaemonOptions = DaemonOptions()):
        if not os.path.isdir(options.shm_dir):
            raise DaemonStartError(f"--shm-dir {options.shm_dir} does not exist")
        shared = pages.detect(options.shm_dir)
        if shared.unusable():
            raise DaemonStartError(shared.unusable())
        if shared.filesystem not in ("tmpfs", "ramfs", "unknown"):
            log.warning("%s is not a tmpfs: snapshots will go through the page cache to disk",
                        options.shm_dir)
        log.info("segments in %s get %s", options.shm_dir, shared.describe())
        self.options = options
        self._server = TrainerServer(
            options.max_message_bytes,
            {"calls": options.rpc_threads, "waits": options.rpc_threads, "status": 2},
            options.max_streams, "--max-streams")
        # Bind first: a daemon that cannot listen must not take shared memory.
        self.port = _bind(self._server.add_port, options.listen, "for trainers")
        path = socket_path(options.listen)
        self.address = f"unix://{os.path.abspath(path)}" if path is not None else \
            f"{options.listen.rsplit(':', 1)[0]}:{self.port}"
        # The peer port before a ring position: with etcd, taking one publishes the
        # address peers dial, and a port another process holds must never be named ours.
        self._peer_server = self._bind_peer_port() if options.peers.enabled else None
        try:
            self.group = self._group() if options.peers.enabled else None
        except BaseException:
            if self._peer_server is not None:
                self._peer_server.stop(None)
            raise
        self.logs = TrainingLogs(options.logs)
        self.store = SnapshotStore(options.shm_dir, _fit_budget_to_shm(options),
                                   grouped=self.group is not None)
        self.heartbeat = Heartbeat(self.store.heartbeat_path)
        self.plans = BubblePlans(self.store.slot_bytes, options.bubbles)
        self.metrics = DaemonMetrics(self.store, self.logs)
        for forget in (self.plans.forget, self.logs.forget):
            self.store.listen(on_job_deleted=forget)
        self.store.listen(on_retained=self.logs.drop_boundary_through)
        self._build_tiers()
        status = Status(self.store, self.plans, self.logs, self.restorer, self.layouts,
                        self.replicator, options.peers.replicas if self.group else 0,
                        self.progress, self.durable)
        self.metrics.watch(status.copies, self.group,
                           options.peers.copies_wanted if self.group else 1, self.data)
        self._server.add_service(
            daemon_pb2.DESCRIPTOR.services_by_name["Daemon"],
            trainer.DaemonServicer(self.store, self.layouts, self.plans, self.restorer,
                                   LogReplication(self.logs, self.group, self.store.layout_of),
                                   status, self.metrics, TrainerToken(options.trainer_token),
                                   self.heartbeat.path, self.durable),
            trainer.LANES)
        self._server.enable_reflection((SERVICE_NAME,))
        self.metrics_address = ""
        self._stopped = threading.Event()

    def _build_tiers(self) -> None:
        """Peers (data channel, transfers, replicator) and the durable tier, as configured;
        what a trainer commits here fans out to them."""
        options = self.options
        self.progress = Progress()
        self.data = self.transfers = self.replicator = None
        self.layouts = GroupLayouts(self.store, self.group, options.peers.refresh_seconds)
        if self.group is not None:
            data_listen = options.peers.data_listen or \
                f"{self.group.own_address.rsplit(':', 1)[0]}:0"
            self.data = DataServer(data_listen, options.peers.security.server_ssl_context())
            self.transfers = Transfers(self.store, self.group, self.data)
            idle = IdleWindows(options.peers.pacing)
            self.plans.listen(idle.observe)
            self.store.listen(on_job_deleted=idle.forget)
            self.replicator = Replicator(self.store, self.group, self.transfers, self.layouts,
                                         self.metrics, idle)
            self.store.listen(on_local=self.replicator.committed)
            self.group.on_summary(self.replicator.summary_changed)
            self.group.on_seated(self.replicator.seated)
            self.store.listen(on_job_deleted=self.group.forget_job)
        reader = self.durable = None
        if options.durable.enabled:
            reader = DurableReader(options.durable.directory)
            try:
                self.durable = DurableWriter(options.durable, self.store, reader, self.metrics,
                                             progress=self.progress)
            except ImportError as err:
                raise DaemonStartError(str(err)) from err
            self.store.listen(on_local=self.durable.committed)
        self.restorer = Restorer(self.store, self.group, self.replicator, self.transfers,
                                 reader, self.durable, on_corrupt=self.metrics.corrupt,
                                 progress=self.progress)
        if self.group is not None:
            self._peer_server.add_generic_rpc_handlers((generic_handler(
                PEER_SERVICE, PeerServicer(self.store, self.logs, self.group, self.transfers,
                                           self.restorer, self.metrics)),))

    def _group(self) -> PeerGroup:
        """The peer group; with etcd, after taking a ring position there."""
        peers = self.options.peers
        etcd = None
        if peers.coordination.enabled:
            etcd = EtcdGroup(peers.coordination, peers.listen, peers.copies_wanted,
                             peers.dead_after_seconds)
            try:
                etcd.start(peers.index)
            except DaemonError as err:
                raise DaemonStartError(str(err)) from None
        return PeerGroup(peers, self.options.max_message_bytes, etcd)

    def _bind_peer_port(self) -> grpc.Server:
        peers = self.options.peers
        interceptors = [TokenInterceptor(peers.security.token)] if peers.security.token else []
        interceptors.append(GroupNameInterceptor(peers.group))
        server = _server(peers.server_threads, self.options.max_message_bytes, "peer",
                         interceptors)
        listen = peers.listen or peers.peers[peers.index]  # the static ring's own entry
        _bind(lambda address: peers.security.add_port(server, address), listen, "for peers")
        return server

    def start(self) -> None:
        self.heartbeat.start()
        self._server.start()
        if socket_path(self.options.listen) is None and not self.options.trainer_token:
            log.warning("trainers call this daemon over TCP (%s), where any local user can "
                        "connect, and no trainer token is set (--trainer-token-file or %s): "
                        "Restore (not alone) and DeleteSnapshots are refused there",
                        self.address, TOKEN_ENV)
        security = self.options.peers.security
        listen = self.options.peers.listen or (self.group.own_address if self.group else "")
        if self.group is not None and not security.token and not security.require_client_cert \
                and not listen.startswith(("127.", "localhost", "[::1]")):
            log.warning("the peer port %s takes calls from anyone who can reach it: no "
                        "--peer-token-file and no --peer-tls-client-auth. Any host could read "
                        "or drop snapshots; see the README's 'Securing peer traffic'", listen)
        if self.group is not None:
            self._peer_server.start()
            self.group.announce()
            self.replicator.start()
        if self.durable is not None:
            self.durable.start()
        if self.options.metrics:
            host, port = self.options.metrics.rsplit(":", 1)
            self.metrics_address = f"{host}:{self.metrics.serve(host, int(port))}"
        self._server.serving(("", SERVICE_NAME))

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._server.stop(self.options.grace_seconds)
        if self.durable is not None:
            self.durable.stop()
        if self.group is not None:
            self.replicator.stop()
            self._peer_server.stop(self.options.grace_seconds).wait()
            self.data.close()
            self.group.close()
        self.heartbeat.stop()
        self.store.close()

    def ready_line(self) -> str:
        memory = self.store.memory()
        peers = {}
        if self.group is not None:
            peers = {"peer_address": self.group.own_address,
                     "peer_index": self.group.index, "data_address": self.data.address}
        return json.dumps({"event": "ready", "address": self.address, **peers,
                           "metrics": self.metrics_address, "shm_dir": memory.shm_dir,
                           "memory_budget_bytes": memory.budget_bytes,
                           "shm_free_bytes": memory.shm_free_bytes,
                           "shm_page_bytes": memory.pages.page_bytes,
                           "shm_pages": memory.pages.describe(), "pid": os.getpid()})


def _lower_priority(nice: int) -> None:
    """Adds ``nice`` to the niceness of every thread of this process. Linux nices one
    thread at a time (``os.nice`` only the caller's), and imports have started threads
    already (numpy's BLAS): one left at the old priority competes with the training
    processes the niceness is for; one below the rest is a priority inversion (see
    store/warm_pool.py)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            now = os.getpriority(os.PRIO_PROCESS, int(tid))
            os.setpriority(os.PRIO_PROCESS, int(tid), min(now + nice, 19))
        except ProcessLookupError:  # the thread ended meanwhile
            continue


#: How often the main thread wakes to run a signal handler another thread received.
_SIGNAL_POLL_SECONDS = 0.5


def run(options: DaemonOptions) -> int:
    """Runs a daemon until SIGTERM or SIGINT; prints one JSON ready line on stdout."""
    if options.nice:
        _lower_priority(options.nice)
    daemon = Daemon(options)
    daemon.start()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    # `kill -USR1 PID` writes every thread's Python stack to the log, the daemon running on:
    # what one that answers nothing waits on. Written from the C handler: no GIL needed.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    print(daemon.ready_line(), flush=True)
    log.info("serving on %s (metrics %s)", daemon.address, daemon.metrics_address or "off")
    # A timed wait: the kernel may hand SIGTERM to any thread (gRPC's, say), and then
    # nothing wakes a main thread blocked for good; Python runs the handler once it wakes.
    while not done.wait(_SIGNAL_POLL_SECONDS):
        pass
    log.info("shutting down: finishing in-flight calls, freeing shared memory")
    daemon.stop()
    sys.stdout.flush()
    return 0
