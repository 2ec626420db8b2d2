"""Orbax v1's pytree handler as the memory tier sees it.

Orbax v1 (``orbax.checkpoint.experimental.v1``) saves a checkpointable that is a pytree
with its ``PyTreeHandler``, inside a v0 compatibility handler that its Checkpointer's
manager drives; the handler's core is Orbax's v0 ``BasePyTreeCheckpointHandler``
(``_handler_impl``), which writes the item's arrays and is then finalized by the v1
handler (merge, metadata). The tier puts itself in front of that core, so the step's
folder, its metadata and its finalizing stay Orbax v1's. A load is v1's own call; the
abstract targets that memory answers exactly are turned into v0 restore arguments here.
"""

import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

from bubblesnap.clients.jax.tier.tier_handler import TierHandler

_COMPATIBILITY = "orbax.checkpoint.experimental.v1._src.handlers.compatibility"
_PYTREE = "orbax.checkpoint.experimental.v1._src.handlers.pytree_handler"
_BASE = "orbax.checkpoint._src.handlers.base_pytree_checkpoint_handler"
_NUMPY_LEAF = "orbax.checkpoint.experimental.v1._src.serialization.numpy_leaf_handler"


def pytree_handler_of(handler):
    """The v1 ``PyTreeHandler`` inside ``handler`` (v1's compatibility handler), with
    Orbax's own core; None for any other handler (a subclass is a handler of its own)."""
    compatibility, pytree = sys.modules.get(_COMPATIBILITY), sys.modules.get(_PYTREE)
    if compatibility is None or pytree is None:
        return None  # v1 not imported: none of its handlers exists
    if not isinstance(handler, compatibility.CompatibilityCheckpointHandler):
        return None
    inner = getattr(handler, "_handler", None)
    if type(inner) is not pytree.PyTreeHandler:
        return None
    core = type(getattr(inner, "_handler_impl", None))
    if core.__module__ != _BASE and core is not TierHandler:
        return None
    return inner


def restore_args(abstract):
    """Orbax's v0 ``PyTreeRestore`` that restores what v1's load of ``abstract`` gives,
    where memory can answer it: every leaf a ``jax.ShapeDtypeStruct`` with a sharding
    (an array placed as it says, cast to its dtype), a numpy shape and dtype (a numpy
    array of that dtype), or the type ``int`` or ``float`` (a Python scalar). None for
    anything else (placeholders, strings, an array with no sharding, a
    ``StatefulCheckpointable``): Orbax v1 reads the folder."""
    leaves = jax.tree.leaves(abstract)
    if not leaves:
        return None
    leaf_args = [_leaf_restore_args(leaf) for leaf in leaves]
    if any(args is None for args in leaf_args):
        return None
    return ocp.args.PyTreeRestore(item=abstract, restore_args=jax.tree.unflatten(
        jax.tree.structure(abstract), leaf_args))


def _leaf_restore_args(leaf):
    if isinstance(leaf, jax.ShapeDtypeStruct):
        if leaf.sharding is None:
            return None
        return ocp.ArrayRestoreArgs(sharding=leaf.sharding, global_shape=leaf.shape,
                                    dtype=leaf.dtype)
    numpy = sys.modules.get(_NUMPY_LEAF)
    if numpy is not None and isinstance(leaf, numpy.NumpyShapeDtype):
        return ocp.RestoreArgs(restore_type=np.ndarray, dtype=leaf.dtype)
    if leaf in (int, float):
        return ocp.RestoreArgs(restore_type=leaf)
    return None


def compatibility_finalize():
    """The finalize of v1's compatibility handler (it does nothing: a v1 handler finishes
    its item in the item's own commit), or None while v1 is not imported."""
    compatibility = sys.modules.get(_COMPATIBILITY)
    return None if compatibility is None else \
        compatibility.CompatibilityCheckpointHandler.finalize
