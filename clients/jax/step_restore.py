"""The items of one step a CheckpointManager restores, from its record and the tiers.

Pytree items come from the daemon (one Restore of every tensor the targets
need, from the fastest tier that holds them), built into the targets' types
(checkpoint_tree.py); JSON items from the record; items Orbax's own handlers
saved from the step's folder, by those handlers.
"""

from bubblesnap.clients.jax import checkpoint_tree


def restore_items(client, folders, handlers: dict, record: dict, wanted, step: int,
                  alone: bool) -> dict:
    """item name -> restored value of each ``wanted`` (checkpoint_items.RestoreItem).
    ``alone``: later steps stay (an older step is read; Orbax keeps later steps)."""
    plans = {w.name: checkpoint_tree.RestorePlan(w.name, record["items"][w.name], w.target,
                                                 w.restore_args, w.saved_types,
                                                 w.fallback_sharding)
             for w in wanted if w.kind == "pytree"}
    tensors = [t for plan in plans.values() for t in plan.wanted]
    restored = {}
    if tensors:
        found = client.restore_leaves([t.name for t in tensors], [t.target for t in tensors],
                                      step, alone, host={t.name for t in tensors if t.host})
        restored = dict(zip([t.name for t in tensors], found.state, strict=True))
    out = {}
    for w in wanted:
        if w.kind == "pytree":
            out[w.name] = plans[w.name].build(restored)
        elif w.kind == "json":
            out[w.name] = record["items"][w.name]["value"]
        else:
            out[w.name] = folders.restore_item(step, w.name, w.args, handlers.get(w.name))
    return out
