"""A pytree item of a step restored from the daemons' memory, where that gives what
Orbax's handler would read from the step's folder.

Orbax's restore arguments that this module takes (``StandardRestore`` with a target or
none; ``PyTreeRestore`` with a target, ``restore_args`` of shardings, meshes, dtypes and
restore types, or none) are restored from memory: one Restore of every tensor the
target needs, from the fastest tier holding the step, built into the types Orbax gives
(checkpoint_tree.py). For anything else (transforms, partial restores, placeholders,
``strict=False``, layouts) :func:`plan` answers None and Orbax's own handler reads the
folder: it decides what such arguments mean, and what error a mismatch raises.
"""

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint._src.serialization import type_handlers

from bubblesnap.clients.jax.tier import checkpoint_tree
from bubblesnap.clients.results import RestoreError


def plan(item: str, record: dict, args) -> checkpoint_tree.RestorePlan | None:
    """How ``item`` of the step whose record is ``record`` comes back for ``args`` (None:
    Orbax's handler restores it, or the target does not match what memory holds)."""
    entry = record["items"].get(item)
    if entry is None or entry.get("kind") != "pytree":
        return None
    target, restore_args, saved_types, fallback = None, None, False, None
    if type(args) is ocp.args.StandardRestore:
        if not args.strict or getattr(args, "support_layout", False):
            return None
        target, fallback = args.item, args.fallback_sharding
    elif type(args) is ocp.args.PyTreeRestore:
        if args.transforms is not None or args.legacy_transform_fn is not None or \
                getattr(args, "partial_restore", False):
            return None
        target, restore_args = args.item, args.restore_args
        saved_types = restore_args is None
    elif args is not None:
        return None
    if _has_placeholder(target) or _has_placeholder(restore_args):
        return None
    try:
        return checkpoint_tree.RestorePlan(item, entry, target, restore_args, saved_types,
                                           fallback)
    except RestoreError:
        return None  # Orbax says how the target differs from the saved tree


def restore(client, item_plan: checkpoint_tree.RestorePlan, step: int):
    """The item's tree, its arrays from the daemons (this step, no later step dropped);
    RestoreError when they cannot give it."""
    tensors = item_plan.wanted
    restored = {}
    if tensors:
        found = client.restore_leaves([t.name for t in tensors], [t.target for t in tensors],
                                      step, alone=True, host={t.name for t in tensors if t.host})
        restored = dict(zip([t.name for t in tensors], found.state, strict=True))
    return item_plan.build(restored)


def _has_placeholder(tree) -> bool:
    if tree is None:
        return False
    return any(leaf is type_handlers.PLACEHOLDER for leaf in jax.tree.leaves(
        tree, is_leaf=lambda x: x is type_handlers.PLACEHOLDER))
