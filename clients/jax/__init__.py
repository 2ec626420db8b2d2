"""The JAX client: snapshot pytrees of jax.Arrays into the local daemon and restore them.

Public names: :class:`CheckpointManager` and :class:`CheckpointManagerOptions` (Orbax's
CheckpointManager with the daemons' memory in front: change one import), the modules
``bubblesnap.clients.jax.training`` (Orbax v1's ``training`` module, its
``Checkpointer`` bubblesnap's) and ``bubblesnap.clients.jax.emergency`` (Orbax's
emergency manager's, its local tier the daemons' memory), and :class:`PersistError` (a
step a daemon took and could not write), :class:`SnapshotClient`, :class:`Restored`, the
pipeline bubble hooks :class:`BubbleSnapshotter` and :class:`BubbleSnapshotOptions`, the
one-step undo of optimizer updates for data-parallel survivors
(:func:`undo_sgd_momentum`, :func:`undo_adamw`, :func:`check_undo` and its
:class:`UndoCheck`, and the decision between undoing and falling back to the snapshot,
:func:`undo_or_restore` and its :class:`UndoDecision`), plus the shared
:class:`ClientOptions`, :class:`SnapshotResult`, :class:`RestoreError` and
:class:`LogError`."""

from bubblesnap.clients.jax.bubbles import BubbleSnapshotOptions, BubbleSnapshotter
from bubblesnap.clients.jax.client import Restored, SnapshotClient
from bubblesnap.clients.jax.inverse_updates import (
    UndoCheck,
    UndoDecision,
    check_undo,
    undo_adamw,
    undo_or_restore,
    undo_sgd_momentum,
)
from bubblesnap.clients.jax.manager.checkpoint_manager import (
    CheckpointManager,
    CheckpointManagerOptions,
)
from bubblesnap.clients.jax.tier.persist_future import PersistError
from bubblesnap.clients.options import ClientOptions
from bubblesnap.clients.results import LogError, RestoreError, SnapshotResult

__all__ = ["BubbleSnapshotOptions", "BubbleSnapshotter", "CheckpointManager",
           "CheckpointManagerOptions", "ClientOptions", "LogError", "PersistError",
           "RestoreError", "Restored", "SnapshotClient", "SnapshotResult", "UndoCheck",
           "UndoDecision", "check_undo", "undo_adamw", "undo_or_restore", "undo_sgd_momentum"]
