"""Libraries used inside training to talk to the local bubblesnap daemon.

``bubblesnap.clients.jax`` snapshots and restores JAX pytrees;
:class:`NumpyClient` does the same for plain numpy arrays.
"""

from bubblesnap.clients._session import ClientOptions, LogError, RestoreError, SnapshotResult
from bubblesnap.clients.numpy_client import NumpyClient

__all__ = ["ClientOptions", "LogError", "NumpyClient", "RestoreError", "SnapshotResult"]
