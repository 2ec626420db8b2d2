"""The memory tier every Orbax manager of bubblesnap's shares: a manager's pytree items as
daemon jobs (memory_tier.py), Orbax's stock handlers with memory in front
(tier_handler.py, orbax_v1.py for v1's PyTreeHandler), an item's tensors and record
handed over and restored (item_snapshot.py, item_restore.py, checkpoint_tree.py),
the daemons' writes as commit futures (persist_future.py) and steps held in memory
only (memory_steps.py).

The managers are rooms of their own on this core, which imports none of them:
Orbax's CheckpointManager (clients/jax/manager/) builds on it, and v1's Checkpointer
(clients/jax/training.py) and the emergency manager (clients/jax/emergency.py) build
on that manager.
"""
