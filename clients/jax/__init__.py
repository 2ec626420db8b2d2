"""The JAX client: snapshot pytrees of jax.Arrays into the local daemon and restore them.

Public names: :class:`SnapshotClient`, :class:`Restored`, the pipeline
bubble hooks :class:`BubbleSnapshotter` and its options, plus the shared
:class:`ClientOptions`, :class:`SnapshotResult`, :class:`RestoreError` and
:class:`LogError`.
"""

from bubblesnap.clients._session import ClientOptions, LogError, RestoreError, SnapshotResult
from bubblesnap.clients.jax.bubbles import BubbleSnapshotOptions, BubbleSnapshotter
from bubblesnap.clients.jax.client import Restored, SnapshotClient

__all__ = ["BubbleSnapshotOptions", "BubbleSnapshotter", "ClientOptions", "LogError",
           "RestoreError", "Restored", "SnapshotClient", "SnapshotResult"]
