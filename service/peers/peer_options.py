"""Where a daemon sits among its peers, and how it calls them: the ``--peers`` flags."""

import dataclasses
import urllib.parse

from bubblesnap.service.coordination.options import CoordinationOptions
from bubblesnap.service.peers.pacing import PacingOptions
from bubblesnap.service.peers.security import PeerSecurity
from bubblesnap.shared.options import require


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerOptions:
    """Where this daemon sits among its peers (``bubblesnap daemon`` flags in brackets).

    Attributes:
      peers: peer gRPC addresses of every daemon of the group, in ring order,
        this one's included (``--peers``). Empty: a lone daemon (no
        replication), unless ``coordination`` names an etcd cluster.
      index: this daemon's position in ``peers`` (``--index``). Default 0.
        With ``coordination``: the ring position to take, -1 for the one this
        daemon's name held last or else the first free one.
      listen: address the peer port binds; default ``peers[index]``
        (``--peer-listen``). Set it to bind another interface (0.0.0.0:PORT)
        than the one peers dial. With ``coordination`` it is the address
        peers dial, published in etcd, and must be given.
      coordination: the etcd backend: membership from leases, holdings and
        commits as keys (``--coordination``). Default off: the static ring.
      data_listen: address of the bulk data channel; default the peer
        host with a free port, peers learn it from each call (``--data-listen``).
      replicas: copies pushed to the next daemons in the ring, k
        (``--replicas``). A step is committed when every rank holds it 1 + k
        times. Default 1.
      security: TLS and token of peer calls.
      group_name: the name every peer call carries; a daemon refuses calls that
        name another group (``--group-name``). Two groups that can reach each
        other's addresses (a host's address reused) need names of their own.
        Default "": the ``--coordination-prefix`` with etcd, else "bubblesnap".
      pacing: whether new copies are pushed in the stages' bubbles, and how long
        one may wait for them (``--pace-replication``, ``--pace-max-wait``).
      call_timeout_seconds: deadline of small peer calls (``--peer-call-timeout``).
        Default 2 s.
      transfer_timeout_seconds: deadline of a replica or restore transfer.
        Default 120 s.
      refresh_seconds: how often the group's holdings are gathered to find
        dead peers, re-replicate and advance retention. Default 1 s.
      dead_after_seconds: a peer that has not answered for this long is
        dead: its copies are made again elsewhere. Shorter would copy
        needlessly whenever a busy peer misses one call. Default 5 s.
      server_threads: threads answering peer calls. Default 16.
      spread_restores: a copy a restore pulls that several live peers hold
        comes from all of them at once, each its share of the slots
        (``--spread-restores``); off, from one, which keeps a restore's traffic
        on one peer's link. Default on.
    """

    peers: tuple[str, ...] = ()
    index: int = 0
    listen: str = ""
    data_listen: str = ""
    replicas: int = 1
    security: PeerSecurity = PeerSecurity()
    group_name: str = ""
    coordination: CoordinationOptions = CoordinationOptions()
    pacing: PacingOptions = PacingOptions()
    call_timeout_seconds: float = 2.0
    transfer_timeout_seconds: float = 120.0
    refresh_seconds: float = 1.0
    dead_after_seconds: float = 5.0
    server_threads: int = 16
    spread_restores: bool = True

    def __post_init__(self):
        require(self, "index", not self.peers or 0 <= self.index < len(self.peers),
                f"a position in the {len(self.peers)} peers", "--index")
        require(self, "replicas", self.replicas >= 0, "0 or more", "--replicas")
        require(self, "replicas", not self.peers or self.replicas < len(self.peers),
                f"less than the {len(self.peers)} daemons in --peers", "--replicas")
        etcd = self.coordination
        if etcd.enabled:
            require(self, "peers", not self.peers, "empty with --coordination (etcd says "
                    "who the peers are)", "--peers")
            require(self, "index", -1 <= self.index < etcd.group_size,
                    f"-1 or a position in the {etcd.group_size} of --group-size", "--index")
            require(self, "replicas", self.replicas < etcd.group_size,
                    f"less than the {etcd.group_size} daemons of --group-size", "--replicas")
            require(self, "listen", bool(self.listen) and not self.listen.startswith("0.0.0.0"),
                    "the HOST:PORT peers dial (published in etcd) with --coordination",
                    "--peer-listen")
        for name, flag in (("call_timeout_seconds", "--peer-call-timeout"),
                           ("transfer_timeout_seconds", ""), ("refresh_seconds", ""),
                           ("dead_after_seconds", "--dead-after")):
            require(self, name, getattr(self, name) > 0, "positive", flag)
        require(self, "server_threads", self.server_threads >= 1, "at least 1")
        require(self, "group_name", len(self.group_name) <= 200 and all(
            " " < c <= "~" for c in self.group_name), "at most 200 printable ASCII "
            "characters, no spaces (gRPC metadata carries it)", "--group-name")

    @property
    def group(self) -> str:
        """The group's name as calls carry it (``group_name`` or its default). A prefix
        is named as its keys are (no trailing "/"), escaped to the ASCII that gRPC
        metadata carries."""
        if self.group_name:
            return self.group_name
        if not self.coordination.enabled:
            return "bubblesnap"
        return urllib.parse.quote(self.coordination.prefix.rstrip("/"), safe="/")

    @property
    def enabled(self) -> bool:
        return len(self.peers) > 1 or self.coordination.enabled

    @property
    def copies_wanted(self) -> int:
        return 1 + self.replicas
