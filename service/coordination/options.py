"""The ``--coordination`` options: the etcd backend of a daemon group."""

import dataclasses

from bubblesnap.service.coordination.etcd_kv import parse_endpoints
from bubblesnap.shared.options import require


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinationOptions:
    """The etcd backend of a daemon group (``bubblesnap daemon`` flags in brackets).

    Attributes:
      url: ``etcd://HOST:PORT[,HOST:PORT...]``, the etcd cluster's client
        endpoints (``--coordination``). Empty: the static ``--peers`` ring.
      prefix: where this group's keys live in etcd; one prefix per group
        (``--coordination-prefix``). Default ``/bubblesnap/default``.
      group_size: ring positions, the daemons the group is made for
        (``--group-size``). Needed with ``url``.
      name: this daemon's stable name, which keeps its ring position over
        restarts (``--name``). Default: its peer address.
      claim_timeout_seconds: how long a starting daemon waits for a free ring
        position (a dead daemon's frees when its lease runs out). Default 60 s.
    """

    url: str = ""
    prefix: str = "/bubblesnap/default"
    group_size: int = 0
    name: str = ""
    claim_timeout_seconds: float = 60.0
    ready_wait_seconds: float = 5.0

    def __post_init__(self):
        if self.url:
            try:
                parse_endpoints(self.url)
            except ValueError as err:
                require(self, "url", False, f"etcd://HOST:PORT[,HOST:PORT...] ({err})",
                        "--coordination")
            require(self, "group_size", self.group_size >= 2, "2 or more with --coordination",
                    "--group-size")
        require(self, "prefix", self.prefix.startswith("/") and len(self.prefix) > 1
                and "//" not in self.prefix, "an absolute key prefix such as /bubblesnap/prod",
                "--coordination-prefix")
        require(self, "claim_timeout_seconds", self.claim_timeout_seconds > 0, "positive")
        require(self, "ready_wait_seconds", self.ready_wait_seconds >= 0, ">= 0")

    @property
    def enabled(self) -> bool:
        return bool(self.url)
