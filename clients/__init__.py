"""Libraries used inside training to talk to the local bubblesnap daemon.

``bubblesnap.clients.jax`` snapshots and restores JAX pytrees;
:class:`NumpyClient` does the same for plain numpy arrays.
:func:`plan_log_groups` chooses which pipeline boundaries to log under a
budget (Swift's selective logging) for stage-local replay.
"""

from bubblesnap.clients._session import ClientOptions, LogError, RestoreError, SnapshotResult
from bubblesnap.clients.log_groups import LogPlan, plan_log_groups, trade_off
from bubblesnap.clients.numpy_client import NumpyClient

__all__ = ["ClientOptions", "LogError", "LogPlan", "NumpyClient", "RestoreError",
           "SnapshotResult", "plan_log_groups", "trade_off"]
