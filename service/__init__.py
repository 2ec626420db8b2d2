"""The bubblesnap daemon: holds snapshots in shared memory and serves them back.

Public names: :class:`Daemon`, :func:`run` and the option dataclasses
:class:`DaemonOptions`, :class:`StoreOptions`, :class:`BubbleOptions`,
:class:`PlannerOptions`, :class:`PeerOptions`, :class:`PeerSecurity`,
:class:`DurableOptions`, :class:`LogOptions`. Everything else is internal to the daemon.
"""

from bubblesnap.service.bubble_plans import BubbleOptions
from bubblesnap.service.daemon import Daemon, DaemonOptions, run
from bubblesnap.service.durable import DurableOptions
from bubblesnap.service.peer_security import PeerSecurity
from bubblesnap.service.peers import PeerOptions
from bubblesnap.service.planner import PlannerOptions
from bubblesnap.service.store import StoreOptions
from bubblesnap.service.training_log import LogOptions

__all__ = ["BubbleOptions", "Daemon", "DaemonOptions", "DurableOptions", "LogOptions",
           "PeerOptions", "PeerSecurity", "PlannerOptions", "StoreOptions", "run"]
