"""A static ring of daemons on loopback (``--peers``, each at its ring position), returned
once every daemon sees every other; a host replaced at its position."""

import uuid
from collections.abc import Callable

from bubblesnap.testing.daemons import DaemonError, DaemonProcess, peers_seen, ring_index
from bubblesnap.testing.etcd import EtcdServer
from bubblesnap.testing.processes import free_port, port_free, wait_for


def wait_connected(daemons: list[DaemonProcess], timeout: float) -> None:
    """Waits until every running one of ``daemons`` (a group, serving metrics) sees every
    running one alive at the ring position it holds now (its ``bubblesnap_peer_alive``
    and ``bubblesnap_ring_index``). A stopped (SIGSTOP) daemon never answers, and one
    out of the ring (with etcd, every position held by others) is never seen:
    TimeoutError."""
    def connected() -> bool:
        running = [d for d in daemons if d.alive()]
        try:
            scraped = [d._metrics(5.0) for d in running]
        except OSError:  # its metrics did not answer in time: a busy daemon
            return False
        indices = {ring_index(text) for text in scraped}
        return all(indices <= peers_seen(text) for text in scraped)
    wait_for(connected, "every daemon of the group to see every other one", timeout=timeout)


class Ring:
    """Daemons that replicate to each other, one per simulated host.

    Daemon ``i`` runs with ``--peers a0,a1,... --index i`` (peer addresses on
    free loopback ports), a ``--group-name`` of the ring's own (``group_name``;
    "" with etcd, where the prefix names the group; a ``--group-name`` in
    ``flags`` replaces it) and ``flags``.
    ``start(*flags, **options)`` makes each daemon (default: :class:`DaemonProcess`;
    a test passes its fixture so the test stops them); ``options`` go to every call
    (``metrics`` defaults to a free port: the ring reads what each daemon sees there).
    :meth:`stop` stops every daemon the ring started, replaced ones included.

    The constructor and :meth:`replace` return once every running daemon sees
    every other one alive (:meth:`wait_connected`): a daemon started before its
    successor would otherwise pass over it with the first copies it pushes.
    """

    def __init__(self, size: int, *flags: str, start: Callable[..., DaemonProcess] = DaemonProcess,
                 etcd: "EtcdServer | None" = None, connect_timeout: float = 120.0, **options):
        self._start, self._flags = start, flags
        self._options = {"metrics": "127.0.0.1:0", **options}
        self._etcd, self._connect_timeout = etcd, connect_timeout
        self.peers = [f"127.0.0.1:{free_port()}" for _ in range(size)]
        # A ring of its own: a port another test's ring chose too must not join the two.
        # With etcd, the prefix names the group (daemons a test starts by hand under it
        # belong to it too).
        given = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f == "--group-name"]
        self.group_name = given[-1] if given else \
            "" if etcd is not None else f"ring-{uuid.uuid4().hex[:12]}"
        self.started: list[DaemonProcess] = []
        self.daemons: list[DaemonProcess] = []
        try:
            for index in range(size):
                self.daemons.append(self._launch(index))
            self.wait_connected()
        except BaseException:
            self.stop()
            raise

    def _launch(self, index: int, claim: bool = False) -> DaemonProcess:
        """Starts daemon ``index`` on ``peers[index]``. Ports are chosen before their
        daemons bind them, and any process may take one meanwhile (an outgoing
        connection's local port, another test's daemon): a daemon that could not start
        because its peer port is taken now is started again on a fresh one, which it
        announces (a Join carries its new address)."""
        attempts = 3
        while True:
            attempts -= 1
            try:
                return self._launch_once(index, claim)
            except DaemonError:
                host, port = self.peers[index].rsplit(":", 1)
                if not attempts or port_free(host, int(port)):
                    raise
                self.peers[index] = f"127.0.0.1:{free_port()}"

    def _launch_once(self, index: int, claim: bool) -> DaemonProcess:
        if self._etcd is None:
            where = ("--peers", ",".join(self.peers), "--index", str(index))
        else:
            where = ("--coordination", self._etcd.url, "--group-size", str(len(self.peers)),
                     "--peer-listen", self.peers[index],
                     *(() if claim else ("--index", str(index))))
        if self.group_name:
            where += ("--group-name", self.group_name)
        daemon = self._start(*where, *self._flags, **{"name": f"daemon {index}", **self._options})
        self.started.append(daemon)
        return daemon

    @property
    def addresses(self) -> list[str]:
        """The daemons' gRPC addresses (for trainers), in ring order."""
        return [daemon.address for daemon in self.daemons]

    def replace(self, index: int) -> DaemonProcess:
        """A fresh daemon (new peer port, empty memory) takes host ``index``'s place; with
        etcd it is not told the index, and takes the free ring position itself."""
        self.peers[index] = f"127.0.0.1:{free_port()}"
        self.daemons[index] = self._launch(index, claim=self._etcd is not None)
        self.wait_connected()
        return self.daemons[index]

    def wait_connected(self, timeout: float | None = None) -> None:
        """Waits until every running daemon of the ring sees every running one alive
        (its ``bubblesnap_peer_alive``); a killed one may still count as alive to the
        others. A stopped (SIGSTOP) daemon never answers: TimeoutError."""
        wait_connected(self.daemons, self._connect_timeout if timeout is None else timeout)

    def stop(self) -> None:
        """Stops every daemon it started (SIGTERM, then SIGKILL), even if one stop fails."""
        errors = []
        for daemon in self.started:
            try:
                daemon.stop()
            except Exception as err:  # keep stopping the others
                errors.append(f"{daemon.name}: {err!r}")
        if errors:
            raise DaemonError("stopping the ring failed: " + "; ".join(errors))
