"""bubblesnap's CheckpointManager: Orbax's own, subclassed, with the daemons' memory in
front (checkpoint_manager.py), and its options (manager_options.py)."""

from bubblesnap.clients.jax.manager.checkpoint_manager import CheckpointManager
from bubblesnap.clients.jax.manager.manager_options import CheckpointManagerOptions

__all__ = ["CheckpointManager", "CheckpointManagerOptions"]
