"""Pure: the ring a daemon derives from the addresses a headless Service lists.

A Kubernetes DaemonSet has no ordinals (a StatefulSet's pod-0, pod-1), and the
Service's DNS answer comes in any order, so every daemon sorts what it was told
the same way: by IP address, numerically. The DaemonSet runs on the host
network, so a pod's IP is its node's IP: a pod restarted or upgraded on the same
node comes back at the same address, therefore at the same ring position, and
its peers take its Join as the same member (group.py keeps the ring's size and
positions; only the address at a position can change). A node added or replaced
changes the sorted list, and with it the positions of the daemons after it: the
ring is fixed when a daemon starts, so such a change needs every daemon
restarted (``kubectl rollout restart``), each adopting what its node's shared
memory holds. ``expected`` (the node count) is what keeps daemons that start at
different moments from deciding on different rings: a daemon waits until the
Service lists exactly that many, itself among them.
"""

import dataclasses
import ipaddress

from bubblesnap.shared.options import is_number, require


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiscoveryOptions:
    """Finding the ring's peers from DNS (``bubblesnap daemon`` flags in brackets).

    Attributes:
      service: ``name:port`` of the headless Service whose A (or AAAA) records
        are the daemons, and the peer port they listen on
        (``--peers-from-dns``). Empty: peers are given by ``--peers``.
      own_address: this daemon's IP as the Service lists it (``--own-address``;
        in Kubernetes the pod's ``status.podIP`` through the downward API).
      expected: how many daemons the ring has (``--peers-expected``; the
        number of nodes the DaemonSet runs on). Daemons wait until the
        Service lists exactly that many, so every one decides on the same ring.
      settle_seconds: how long the answer must stay the same before it is
        taken; a pod that is being replaced may be listed, then not. Default 5 s.
      poll_seconds: how often the Service is asked while waiting. Default 1 s.
      timeout_seconds: how long to wait in all before the daemon gives up
        (and its pod is restarted). Default 600 s: a DaemonSet's pods on a
        large cluster can take minutes to be scheduled and pull the image.
    """

    service: str = ""
    own_address: str = ""
    expected: int = 0
    settle_seconds: float = 5.0
    poll_seconds: float = 1.0
    timeout_seconds: float = 600.0

    def __post_init__(self):
        if not self.service:
            return
        name, _, port = self.service.rpartition(":")
        require(self, "service", bool(name) and port.isdigit() and 0 < int(port) < 65536,
                "NAME:PORT (the headless Service and the peer port)", "--peers-from-dns")
        require(self, "own_address", _ip(self.own_address) is not None,
                "this daemon's IP address as the Service lists it", "--own-address")
        require(self, "expected", self.expected >= 2, "the number of daemons, 2 or more",
                "--peers-expected")
        for name in ("settle_seconds", "poll_seconds", "timeout_seconds"):
            value = getattr(self, name)
            require(self, name, is_number(value) and value >= 0, "0 or more seconds")

    @property
    def enabled(self) -> bool:
        return bool(self.service)

    @property
    def port(self) -> int:
        return int(self.service.rpartition(":")[2])


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def ring(listed, own_address: str, port: int) -> tuple[tuple[str, ...], int]:
    """The ring (``host:port`` of every daemon, sorted by IP) and this daemon's index in
    it, from the addresses ``listed`` (duplicates and the other IP family dropped: a
    dual-stack Service lists each pod twice). ValueError if ``own_address`` is not
    listed (its pod's endpoint is not published yet)."""
    own = _ip(own_address)
    ips = sorted({ip for ip in map(_ip, listed) if ip is not None and ip.version == own.version})
    if own not in ips:
        raise ValueError(f"this daemon's address {own_address} is not among the "
                         f"{len(ips)} the Service lists")
    peers = tuple(f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}" for ip in ips)
    return peers, ips.index(own)


def waiting_for(listed, options: DiscoveryOptions) -> str:
    """Why the answer ``listed`` cannot be taken yet ("" when it can, once it has been the
    same for ``settle_seconds``)."""
    try:
        peers, _ = ring(listed, options.own_address, options.port)
    except ValueError as err:
        return str(err)
    if len(peers) != options.expected:
        return (f"the Service lists {len(peers)} daemons ({', '.join(peers)}), "
                f"--peers-expected is {options.expected}")
    return ""
