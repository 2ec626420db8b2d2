"""Libraries used inside training to talk to the local bubblesnap daemon.

``bubblesnap.clients.jax`` snapshots and restores JAX pytrees;
:class:`NumpyClient` does the same for plain numpy arrays. Both are a
:class:`DaemonClient` (the training log, waiting, status, closing), built on
a :class:`Session` (the calls to the daemon, with deadlines and back-off),
and take :class:`ClientOptions`; snapshots answer a :class:`SnapshotResult`,
failures raise :class:`RestoreError` or :class:`LogError`.

Pipelines: :class:`PipelineHooks` is what a pipeline runtime calls each
iteration (``BubbleSnapshotter`` in ``bubblesnap.clients.jax`` implements
it, :class:`NoSnapshots` does nothing); :class:`LoggedSteps` wraps hooks so
each step's log records are sent as it begins and held before it ends.
:class:`BoundaryLog` logs the tensors crossing pipeline boundaries for
stage-local replay, and :func:`plan_log_groups` chooses which boundaries
to log under a budget (Swift's selective logging, :class:`LogPlan`;
:func:`trade_off` lists every choice). A failed stage's lost steps can be
replayed by several workers: :func:`replay_shares` says which microbatches
each takes, :func:`combine_in_order` sums their gradients as the step did.
"""

from bubblesnap.clients.boundary_log import BoundaryLog
from bubblesnap.clients.daemon_client import DaemonClient
from bubblesnap.clients.log_groups import LogPlan, plan_log_groups, trade_off
from bubblesnap.clients.numpy_client import NumpyClient
from bubblesnap.clients.options import ClientOptions
from bubblesnap.clients.pipeline_hooks import LoggedSteps, NoSnapshots, PipelineHooks
from bubblesnap.clients.replay_shares import combine_in_order, replay_shares
from bubblesnap.clients.results import LogError, RestoreError, SnapshotResult
from bubblesnap.clients.session import Session

__all__ = ["BoundaryLog", "ClientOptions", "DaemonClient", "LogError", "LogPlan", "LoggedSteps",
           "NoSnapshots", "NumpyClient", "PipelineHooks", "RestoreError", "Session",
           "SnapshotResult", "combine_in_order", "plan_log_groups", "replay_shares", "trade_off"]
