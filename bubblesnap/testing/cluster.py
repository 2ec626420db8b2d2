"""A cluster on one machine: each host a network namespace with a daemon, its own address
and a shaped link; faults (partitions, frozen and killed daemons, slow links) as methods.

    from bubblesnap.testing import Cluster

    with Cluster(3, "--replicas", "1", rate="1gbit") as cluster:
        trainer = cluster.hosts[0].popen([sys.executable, "train.py"])   # runs on host 0
        cluster.partition([0], [1, 2])      # host 0 cut off from the others
        cluster.heal()
        cluster.freeze(1); cluster.thaw(1)  # SIGSTOP / SIGCONT of host 1's daemon
        cluster.slow(2, "100mbit")          # host 2's link, both ways

    with Cluster(3, "--replicas", "1", etcd=True) as cluster:
        cluster.partition([0], [1, 2, "etcd"])
        spare = cluster.add_host()          # host 3 takes host 0's position once it frees

Every host is a namespace ``bsNNN-i`` joined to a bridge ``bsNNNbr`` by a veth
pair, with the address ``198.18.X.(i+1)`` of a /24 taken from 198.18.0.0/15
(reserved for network benchmarks: nothing is routed off the machine); the
bridge's own ``.254`` lets this process reach every host (metrics, health).
Daemons listen for trainers on Unix sockets, which every namespace reaches.
A partition is a blackhole route on both sides: a host's new connections to
the other side fail at once, and what the other side sends it is dropped
unanswered. Links are shaped with ``tbf`` on both ends of the veth pair.

Nothing outlives it: :meth:`Cluster.close` (the end of the ``with`` block,
also after a failed test) and, should this process be SIGKILLed, its reaper
remove every process, namespace, link and shared-memory folder it made.
Needs root and iproute2: :func:`unavailable` says why not, in one line.
"""

import fcntl
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field

from bubblesnap.testing import reaper
from bubblesnap.testing.daemons import DaemonProcess
from bubblesnap.testing.etcd import EtcdServer
from bubblesnap.testing.processes import in_netns
from bubblesnap.testing.ring import wait_connected

#: The port every host's daemon takes for its peers (each namespace has its own ports).
PEER_PORT = 7100
#: The port of every host's metrics endpoint.
METRICS_PORT = 9100
#: The last octet of etcd's host, the S3 server's and the bridge's (this process's side).
_ETCD_OCTET, _S3_OCTET, _BRIDGE_OCTET = 250, 251, 254
#: Clusters that may exist at once on one machine: one /24 of 198.18.0.0/15 each.
_SLOTS = 512


class ClusterError(RuntimeError):
    """A network command failed; the message holds the command and what it printed."""


def _ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    command = [*in_netns(netns), *args]
    done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and done.returncode:
        raise ClusterError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def unavailable() -> str | None:
    """Why no Cluster can be made here (one line), or None when one can."""
    if os.geteuid() != 0:
        return "needs root for network namespaces (ip netns), and this process is not root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc), not found on PATH"
    _remove_dead_probes()
    probe = f"{_PROBE}{os.getpid()}"
    try:
        _ip("ip", "netns", "add", probe)
    except ClusterError as err:
        return f"cannot make a network namespace: {err}"
    _ip("ip", "netns", "del", probe, check=False)
    return None


#: The namespace :func:`unavailable` makes and deletes at once, named for its process.
_PROBE = "bsprobe-"


def _remove_dead_probes() -> None:
    """Deletes the probe namespaces of processes killed between making and deleting one
    (a SIGKILLed test run): nothing else would."""
    for line in _ip("ip", "netns", "list", check=False).splitlines():
        name = line.split(" ", 1)[0]
        pid = name[len(_PROBE):]
        if name.startswith(_PROBE) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _ip("ip", "netns", "del", name, check=False)


@dataclass
class Host:
    """One host: its namespace, address, link and daemon, and the programs run on it."""

    index: int
    netns: str
    address: str
    link: str  # this side's end of its veth pair (the namespace's end is eth0)
    shm_dir: str  # outlives its daemon: a restarted daemon adopts what a killed one left
    daemon: DaemonProcess | None = None
    programs: list[tuple[subprocess.Popen, int]] = field(default_factory=list)  # reaped

    @property
    def peer_address(self) -> str:
        return f"{self.address}:{PEER_PORT}"

    def popen(self, argv: list[str], **popen) -> subprocess.Popen:
        """Starts ``argv`` on this host (in its namespace), as :class:`subprocess.Popen`
        with ``popen``; killed with the cluster (or its reaper) unless it ended first."""
        proc = subprocess.Popen([*in_netns(self.netns), *argv], **popen)
        self.programs.append((proc, reaper.adopt(proc.pid)))
        return proc


class Cluster:
    """``size`` hosts, each running a daemon with ``flags`` in a ring (``--peers``) or,
    with ``etcd=True``, coordinated by an etcd in a namespace of its own (``--group-size``
    ``size`` unless ``flags`` say otherwise; :meth:`add_host` adds a spare host).

    With ``s3=True`` an S3 server (SeaweedFS, :class:`bubblesnap.testing.object_stores.SeaweedS3`)
    runs on a host of its own, ``"s3"`` to :meth:`partition` and :meth:`slow`; every
    daemon's environment names it (its ``url`` is :attr:`s3`'s).

    ``rate`` and ``burst`` shape every host's link both ways (tbf; None: unshaped).
    ``directory`` keeps the daemons' logs (``host<i>.log``) and etcd's data (default:
    a temporary folder, removed on close). ``daemon_options`` go to every
    :class:`~bubblesnap.testing.DaemonProcess`. Returns once every daemon sees every
    other one.
    """

    def __init__(self, size: int, *flags: str, rate: str | None = None, burst: str = "256kb",
                 etcd: bool = False, s3: bool = False, directory: str | None = None,
                 connect_timeout: float = 120.0, **daemon_options):
        reason = unavailable()
        if reason:
            raise ClusterError(reason)
        if not 1 <= size < _ETCD_OCTET - 1:
            raise ValueError(f"a cluster has 1 to {_ETCD_OCTET - 2} hosts, not {size}")
        self._flags, self._options, self._burst = flags, daemon_options, burst
        self._size = size  # the ring's positions, whatever hosts are added
        self._rate = rate
        self._own_directory = directory is None
        self.directory = directory or tempfile.mkdtemp(prefix="bubblesnap-cluster-")
        os.makedirs(self.directory, exist_ok=True)
        self._blackholes: set[tuple[str, str]] = set()  # (namespace, address) pairs
        self._frozen: set[int] = set()
        self.hosts: list[Host] = []
        self.etcd: EtcdServer | None = None
        self._etcd_host: Host | None = None
        self.s3 = None  # object_stores.SeaweedS3
        self._s3_host: Host | None = None
        self._cleanup: list[int] = []  # the reaper's tokens for what close() removes
        self.bridge: str | None = None
        self._made: tuple = ([], [], [])  # namespaces, links, folders: what close() removes
        try:
            self._make_network(size, etcd, s3)
            for host in self.hosts:
                self._start_daemon(host)
            wait_connected(self.daemons, connect_timeout)
        except BaseException:
            self.close()
            raise

    # -- the network ---------------------------------------------------------------------

    def _make_network(self, size: int, etcd: bool, s3: bool) -> None:
        with open(os.path.join(tempfile.gettempdir(), "bubblesnap-cluster.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two clusters made at once take two slots
            slot = self._free_slot()
            self.tag = f"bs{slot:03d}"
            self.subnet = f"198.{18 + slot // 256}.{slot % 256}"
            _ip("ip", "link", "add", f"{self.tag}br", "type", "bridge")
            self.bridge = f"{self.tag}br"
        shms = [f"/dev/shm/bubblesnap-cluster-{self.tag}-{i}" for i in range(size)]
        names = [f"{self.tag}-{i}" for i in range(size)] + ([f"{self.tag}-etcd"] if etcd else []) \
            + ([f"{self.tag}-s3"] if s3 else [])
        # should this process die before close(), its reaper removes the network
        links = [f"{self.tag}h{i}" for i in range(size)] + ([f"{self.tag}he"] if etcd else []) \
            + ([f"{self.tag}hs"] if s3 else [])
        self._made = (names, links, shms)  # made or half made
        self._cleanup.append(reaper.run_at_end(
            [["ip", "netns", "del", name] for name in names]
            + [["ip", "link", "del", link] for link in links]
            + [["ip", "link", "del", self.bridge],
               ["rm", "-rf", *shms, *([self.directory] if self._own_directory else [])]]))
        _ip("ip", "addr", "add", f"{self.subnet}.{_BRIDGE_OCTET}/24", "dev", self.bridge)
        _ip("ip", "link", "set", self.bridge, "up")
        for i in range(size):
            os.makedirs(shms[i], exist_ok=True)
            self.hosts.append(self._make_host(i, f"{self.tag}-{i}", f"{self.subnet}.{i + 1}",
                                              f"{self.tag}h{i}", shms[i]))
        if etcd:
            self._etcd_host = self._make_host(-1, f"{self.tag}-etcd",
                                              f"{self.subnet}.{_ETCD_OCTET}", f"{self.tag}he", "")
            self.etcd = EtcdServer(self.directory, host=self._etcd_host.address,
                                   netns=self._etcd_host.netns)
        if s3:
            from bubblesnap.testing.object_stores import SeaweedS3

            self._s3_host = self._make_host(-2, f"{self.tag}-s3", f"{self.subnet}.{_S3_OCTET}",
                                            f"{self.tag}hs", "")
            self.s3 = SeaweedS3(os.path.join(self.directory, "s3"),
                                host=self._s3_host.address, netns=self._s3_host.netns)

    @staticmethod
    def _free_slot() -> int:
        """The lowest slot no bridge on this machine uses (a dead cluster's kept one)."""
        used = {int(m) for m in re.findall(r"\d+: bs(\d{3})br[@:]", _ip("ip", "-o", "link"))}
        for slot in range(_SLOTS):
            if slot not in used:
                return slot
        raise ClusterError(f"all {_SLOTS} cluster slots are taken (links bsNNNbr)")

    def _make_host(self, index: int, netns: str, address: str, link: str, shm: str) -> Host:
        _ip("ip", "netns", "add", netns)
        _ip("ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("ip", "link", "set", link, "master", self.bridge, "up")
        _ip("ip", "addr", "add", f"{address}/24", "dev", "eth0", netns=netns)
        _ip("ip", "link", "set", "eth0", "up", netns=netns)
        _ip("ip", "link", "set", "lo", "up", netns=netns)
        host = Host(index, netns, address, link, shm)
        if self._rate is not None:
            self._shape(host, self._rate)
        return host

    def _shape(self, host: Host, rate: str | None) -> None:
        for netns, dev in ((host.netns, "eth0"), (None, host.link)):
            if rate is None:
                _ip("tc", "qdisc", "del", "dev", dev, "root", netns=netns, check=False)
            else:
                _ip("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst",
                    self._burst, "latency", "50ms", netns=netns)

    # -- daemons -------------------------------------------------------------------------

    @property
    def daemons(self) -> list[DaemonProcess]:
        """Every host's daemon, in ring order."""
        return [host.daemon for host in self.hosts]

    @property
    def peers(self) -> list[str]:
        """The daemons' peer addresses, in ring order."""
        return [host.peer_address for host in self.hosts]

    def _start_daemon(self, host: Host, claim: bool = False,
                      position: int | None = None) -> DaemonProcess:
        if self.etcd is None:
            where = ("--peers", ",".join(self.peers), "--index", str(host.index))
        else:
            where = ("--coordination", self.etcd.url, "--group-size", str(self._size),
                     "--peer-listen", host.peer_address,
                     *(() if claim else ("--index", str(host.index if position is None
                                                         else position))))
        options = {"metrics": f"{host.address}:{METRICS_PORT}", "own_shm_dir": False,
                   "stderr": os.path.join(self.directory, f"host{host.index}.log"),
                   **self._options}
        if self.s3 is not None:
            options["env"] = {**self.s3.env, **options.get("env", {})}
        host.daemon = DaemonProcess(*where, "--shm-dir", host.shm_dir, *self._flags,
                                    name=f"host {host.index}", netns=host.netns, **options)
        return host.daemon

    def add_host(self, index: int = -1) -> int:
        """A spare host, beyond the ring's size (with etcd only), as a replacement host:
        its daemon takes ring position ``index`` (``--index``), or, with -1, a free one,
        waiting for it to free (a daemon's lease to run out). Returns the host's index in
        :attr:`hosts` once its daemon holds a position; does not wait for the others to
        see it (a host cut off from them never would)."""
        if self.etcd is None:
            raise ValueError("a spare host needs etcd (Cluster(..., etcd=True)): a --peers "
                             "ring has no position for it")
        position, index = index, len(self.hosts)
        if index >= _ETCD_OCTET - 2:
            raise ValueError(f"a cluster has at most {_ETCD_OCTET - 2} hosts")
        names, links, shms = self._made
        netns, link = f"{self.tag}-{index}", f"{self.tag}h{index}"
        shm = f"/dev/shm/bubblesnap-cluster-{self.tag}-{index}"
        names.append(netns)  # close() removes it, made or half made
        links.append(link)
        shms.append(shm)
        self._cleanup.append(reaper.run_at_end([["ip", "netns", "del", netns],
                                                ["ip", "link", "del", link],
                                                ["rm", "-rf", shm]]))
        os.makedirs(shm, exist_ok=True)
        self.hosts.append(self._make_host(index, netns, f"{self.subnet}.{index + 1}", link,
                                          shm))
        self._start_daemon(self.hosts[index], claim=position < 0,
                           position=position)
        return index

    def _member(self, member: int | str) -> Host:
        if member == "s3":
            if self._s3_host is None:
                raise ValueError("this cluster runs no S3 server (Cluster(..., s3=True))")
            return self._s3_host
        if member == "etcd":
            if self._etcd_host is None:
                raise ValueError("this cluster runs no etcd (Cluster(..., etcd=True))")
            return self._etcd_host
        return self.hosts[member]

    # -- faults --------------------------------------------------------------------------

    def partition(self, side_a, side_b) -> None:
        """Cuts every host of ``side_a`` off from every one of ``side_b`` (host indices,
        or ``"etcd"``), both ways, until :meth:`heal`."""
        for a in map(self._member, side_a):
            for b in map(self._member, side_b):
                for near, far in ((a, b), (b, a)):
                    _ip("ip", "route", "replace", "blackhole", f"{far.address}/32",
                        netns=near.netns)
                    self._blackholes.add((near.netns, far.address))

    def heal(self) -> None:
        """Ends every partition."""
        for netns, address in sorted(self._blackholes):
            _ip("ip", "route", "del", "blackhole", f"{address}/32", netns=netns, check=False)
        self._blackholes.clear()

    def freeze(self, host: int) -> None:
        """SIGSTOP of the host's daemon: alive, holding its sockets, answering nothing
        (returns once every thread of it stopped: ``testing.freeze``)."""
        self.hosts[host].daemon.freeze()
        self._frozen.add(host)

    def thaw(self, host: int) -> None:
        """SIGCONT of a frozen daemon."""
        self.hosts[host].daemon.thaw()
        self._frozen.discard(host)

    def kill(self, host: int, wipe_memory: bool = True) -> int:
        """SIGKILL of the host's daemon; with ``wipe_memory`` its shared memory goes too
        (the host is lost), else a restarted daemon adopts it (the daemon crashed)."""
        self._frozen.discard(host)
        code = self.hosts[host].daemon.kill()
        if wipe_memory:
            shutil.rmtree(self.hosts[host].shm_dir, ignore_errors=True)
            os.makedirs(self.hosts[host].shm_dir)
        return code

    def restart(self, host: int, claim: bool = False,
                connect_timeout: float = 120.0) -> DaemonProcess:
        """A new daemon on the host, same address and flags (its old one is killed first
        if it still runs); with etcd and ``claim`` it is not told its index. Returns once
        every daemon sees every other one."""
        if self.hosts[host].daemon.alive():
            self.kill(host, wipe_memory=False)
        daemon = self._start_daemon(self.hosts[host], claim=claim)
        wait_connected(self.daemons, connect_timeout)
        return daemon

    def slow(self, host: int | str, rate: str | None) -> None:
        """Shapes the host's link (or ``"s3"``'s, ``"etcd"``'s) both ways to ``rate``
        (tbf: "100mbit"); None: back to the cluster's own rate."""
        self._shape(self._member(host), rate if rate is not None else self._rate)

    # -- the end -------------------------------------------------------------------------

    def close(self) -> None:
        """Stops every program and daemon, removes every namespace, link and folder."""
        for host in self.hosts:
            for proc, token in host.programs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                reaper.release(token)
            if host.daemon is not None:
                if host.index in self._frozen:
                    self.thaw(host.index)
                host.daemon.stop(timeout=10)
        if self.etcd is not None:
            self.etcd.kill()
        if self.s3 is not None:
            self.s3.kill()
        names, links, shms = self._made
        for name in names:
            _ip("ip", "netns", "del", name, check=False)
        # a namespace's veth end goes with it, but the kernel may tear a namespace down
        # late: this side's end is removed now
        for link in links:
            _ip("ip", "link", "del", link, check=False)
        for shm in shms:
            shutil.rmtree(shm, ignore_errors=True)
        if self.bridge is not None:
            _ip("ip", "link", "del", self.bridge, check=False)
        for token in self._cleanup:
            reaper.release(token)
        self._cleanup = []
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

