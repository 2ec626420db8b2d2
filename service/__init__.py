"""The bubblesnap daemon: holds snapshots in shared memory and serves them back.

Public names: :class:`Daemon`, :func:`run` and the option dataclasses
:class:`DaemonOptions`, :class:`StoreOptions`, :class:`BubbleOptions`,
:class:`PlannerOptions`. Everything else is internal to the daemon.
"""

from bubblesnap.service.bubble_plans import BubbleOptions
from bubblesnap.service.daemon import Daemon, DaemonOptions, run
from bubblesnap.service.planner import PlannerOptions
from bubblesnap.service.store import StoreOptions

__all__ = ["BubbleOptions", "Daemon", "DaemonOptions", "PlannerOptions", "StoreOptions", "run"]
