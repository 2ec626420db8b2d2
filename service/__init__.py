"""The bubblesnap daemon: holds snapshots in shared memory and serves them back.

Public names: :class:`Daemon`, :class:`DaemonOptions`, :class:`StoreOptions`,
:func:`run`. Everything else is internal to the daemon.
"""

from bubblesnap.service.daemon import Daemon, DaemonOptions, run
from bubblesnap.service.store import StoreOptions

__all__ = ["Daemon", "DaemonOptions", "StoreOptions", "run"]
