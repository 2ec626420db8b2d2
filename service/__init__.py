"""The bubblesnap daemon: holds snapshots in shared memory and serves them back.

Public names: :class:`Daemon`, :func:`run`, :class:`DaemonStartError` and
the option dataclasses :class:`DaemonOptions`, :class:`StoreOptions`,
:class:`BubbleOptions`, :class:`PlannerOptions`, :class:`PeerOptions`,
:class:`PeerSecurity`, :class:`PacingOptions` (replication in bubbles),
:class:`CoordinationOptions` (the etcd backend),
:class:`DiscoveryOptions`, :class:`DurableOptions`,
:class:`LogOptions`; :func:`discover` (peers from a headless Service's DNS) and
:class:`DiscoveryError`.
Everything else is internal to the daemon; ARCHITECTURE.md maps it.
"""

from bubblesnap.service.bubbles import BubbleOptions, PlannerOptions
from bubblesnap.service.coordination.options import CoordinationOptions
from bubblesnap.service.daemon import Daemon, DaemonOptions, DaemonStartError, run
from bubblesnap.service.durable import DurableOptions
from bubblesnap.service.logs import LogOptions
from bubblesnap.service.peers.discovery import DiscoveryOptions
from bubblesnap.service.peers.dns_discovery import DiscoveryError, discover
from bubblesnap.service.peers.pacing import PacingOptions
from bubblesnap.service.peers.peer_options import PeerOptions
from bubblesnap.service.peers.security import PeerSecurity
from bubblesnap.service.store import StoreOptions

__all__ = ["BubbleOptions", "CoordinationOptions", "Daemon", "DaemonOptions", "DaemonStartError",
           "DiscoveryError", "DiscoveryOptions", "DurableOptions", "LogOptions", "PacingOptions",
           "PeerOptions", "PeerSecurity", "PlannerOptions", "StoreOptions", "discover", "run"]
