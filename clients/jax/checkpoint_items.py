"""What a CheckpointManager call saves or restores, item by item, from Orbax's arguments.

Orbax says what an item is by its args (``ocp.args.StandardSave``,
``PyTreeSave``, ``JsonSave``, ``Composite`` of them, ...) or, for the legacy
``items=`` form and for restores without args, by the item's handler
(``item_handlers``). Here that becomes one :class:`SaveItem` or
:class:`RestoreItem` per item, of one kind:

- ``pytree`` (Standard, PyTree): held in memory (checkpoint_tree.py);
- ``json`` (Json): a JSON value held in the step record;
- ``orbax`` (any other args: ProtoSave, random keys, a data loader's own
  handler, ArraySave): saved and restored by Orbax's own handler for those
  args, in the step's folder of the durable tier.

A manager of one unnamed item (Orbax's "default item" mode: args that are no
``Composite``) names it :data:`DEFAULT_ITEM`, as Orbax does on disk.
"""

import dataclasses

import orbax.checkpoint as ocp

from bubblesnap import checkpoint_record

#: Orbax's name of the one item of a manager in default-item mode (its folder in a step).
DEFAULT_ITEM = "default"

_PYTREE_SAVES = (ocp.args.StandardSave, ocp.args.PyTreeSave)
_PYTREE_RESTORES = (ocp.args.StandardRestore, ocp.args.PyTreeRestore)


@dataclasses.dataclass(frozen=True)
class SaveItem:
    """One item to save: its ``kind``, the handler Orbax names in the step's metadata,
    and ``value`` (the pytree, the JSON value, or for ``orbax`` the args object);
    ``save_args``: a PyTreeSave's per-leaf ``SaveArgs`` (their ``dtype`` casts)."""

    name: str
    kind: str
    handler: str
    value: object
    save_args: object = None
    custom_metadata: object = None


@dataclasses.dataclass(frozen=True)
class RestoreItem:
    """One item to restore: its ``kind``; for a pytree the ``target`` (None: as saved)
    and Orbax's ``restore_args``; for ``orbax`` the args its handler restores with
    (None: the handler's defaults)."""

    name: str
    kind: str
    target: object = None
    restore_args: object = None
    args: object = None
    saved_types: bool = False
    fallback_sharding: object = None


def typestr(handler) -> str:
    """The name Orbax records for a handler (object or class) in ``_CHECKPOINT_METADATA``."""
    cls = handler if isinstance(handler, type) else type(handler)
    named = getattr(cls, "typestr", None)
    if callable(named):
        try:
            return str(named())
        except TypeError:  # an instance method
            pass
    return f"{cls.__module__}.{cls.__qualname__}"


def is_composite(args) -> bool:
    return isinstance(args, ocp.args.Composite)


def save_items(args, items, save_kwargs, single: bool, handlers: dict) -> list[SaveItem]:
    """The items of one ``save``. ``single``: the manager's default-item mode;
    ``handlers``: item name -> the handler given at construction."""
    if args is not None:
        if not isinstance(args, ocp.args.CheckpointArgs):
            raise ValueError(f"save: args must be Orbax CheckpointArgs (ocp.args.StandardSave"
                             f"(state), ...), got {type(args).__name__}")
        if is_composite(args) == single:
            raise ValueError("save: a manager of one unnamed item takes args that are not "
                             "Composite" if single else "save: a manager of named items "
                             "(item_names, item_handlers) takes args=ocp.args.Composite(...)")
        pairs = [(DEFAULT_ITEM, args)] if single else list(args.items())
        return [_save_item(name, arg) for name, arg in pairs]
    if items is None:
        raise ValueError("save: give args=ocp.args.StandardSave(state) (or the legacy items=)")
    # Orbax's legacy form: the pytree itself, or item name -> pytree, with save_kwargs.
    pairs = [(DEFAULT_ITEM, items, save_kwargs)] if single else [
        (name, value, (save_kwargs or {}).get(name)) for name, value in items.items()]
    out = []
    for name, value, kwargs in pairs:
        handler = handlers.get(name)
        if handler is not None and isinstance(handler, ocp.JsonCheckpointHandler):
            out.append(_save_item(name, ocp.args.JsonSave(value)))
        else:
            out.append(_save_item(name, ocp.args.PyTreeSave(
                value, save_args=(kwargs or {}).get("save_args"))))
    return out


def _save_item(name: str, args) -> SaveItem:
    checkpoint_record.check_item_name(name)
    if isinstance(args, _PYTREE_SAVES):
        handler = ocp.StandardCheckpointHandler if isinstance(args, ocp.args.StandardSave) \
            else ocp.PyTreeCheckpointHandler
        return SaveItem(name, "pytree", typestr(handler), args.item,
                        getattr(args, "save_args", None), getattr(args, "custom_metadata", None))
    if isinstance(args, ocp.args.JsonSave):
        return SaveItem(name, "json", typestr(ocp.JsonCheckpointHandler), args.item)
    return SaveItem(name, "orbax", typestr(ocp.args.get_registered_handler_cls(args)), args)


def as_args(item: SaveItem):
    """The Orbax args that save ``item`` with its own handler."""
    if item.kind == "json":
        return ocp.args.JsonSave(item.value)
    if item.kind == "pytree":
        if item.handler == typestr(ocp.StandardCheckpointHandler):
            return ocp.args.StandardSave(item.value, save_args=item.save_args,
                                         custom_metadata=item.custom_metadata)
        return ocp.args.PyTreeSave(item.value, save_args=item.save_args,
                                   custom_metadata=item.custom_metadata)
    return item.value


def restore_items(args, items, restore_kwargs, single: bool, handlers: dict,
                  saved: dict) -> list[RestoreItem]:
    """The items of one ``restore``; ``saved``: the step record's items (what the step
    holds). No args: every item saved, as saved (Orbax's restore without args)."""
    if args is not None:
        if not isinstance(args, ocp.args.CheckpointArgs):
            raise ValueError(f"restore: args must be Orbax CheckpointArgs (ocp.args."
                             f"StandardRestore(abstract_state), ...), got {type(args).__name__}")
        pairs = list(args.items()) if is_composite(args) else [(DEFAULT_ITEM, args)]
        return [_restore_item(name, arg, saved) for name, arg in pairs]
    if items is not None:  # the legacy form: targets (and restore_kwargs) per item
        pairs = [(DEFAULT_ITEM, items, restore_kwargs)] if single else [
            (name, value, (restore_kwargs or {}).get(name)) for name, value in items.items()]
        return [_restore_item(name, ocp.args.JsonRestore() if saved.get(name, {}).get(
            "kind") == "json" else ocp.args.PyTreeRestore(
                value, restore_args=(kwargs or {}).get("restore_args")), saved)
            for name, value, kwargs in pairs]
    return [_default_restore(name, entry, handlers.get(name)) for name, entry in saved.items()]


def _restore_item(name: str, args, saved: dict) -> RestoreItem:
    entry = saved.get(name)
    if entry is None:
        raise KeyError(f"restore: the step has no item {name!r}; it holds {sorted(saved)}")
    if isinstance(args, _PYTREE_RESTORES) and entry["kind"] == "pytree":
        if getattr(args, "transforms", None) is not None or \
                getattr(args, "legacy_transform_fn", None) is not None:
            raise ValueError(f"restore: item {name!r}: PyTreeRestore transforms are not "
                             "supported by bubblesnap's manager; restore into the structure "
                             "the item was saved with and transform the result")
        restore_args = getattr(args, "restore_args", None)
        return RestoreItem(name, "pytree", args.item, restore_args,
                           saved_types=isinstance(args, ocp.args.PyTreeRestore)
                           and restore_args is None,
                           fallback_sharding=getattr(args, "fallback_sharding", None))
    if isinstance(args, ocp.args.JsonRestore) and entry["kind"] == "json":
        return RestoreItem(name, "json")
    if entry["kind"] == "orbax" or isinstance(args, (*_PYTREE_RESTORES, ocp.args.JsonRestore)):
        # Saved by Orbax's handler (or saved in memory but asked of another handler):
        # that handler reads the step's folder.
        return RestoreItem(name, "orbax", args=args)
    raise ValueError(f"restore: item {name!r} was saved as {entry['kind']} ({entry['handler']}); "
                     f"{type(args).__name__} cannot restore it")


def _default_restore(name: str, entry: dict, handler) -> RestoreItem:
    if entry["kind"] in ("pytree", "json"):
        return RestoreItem(name, entry["kind"])
    return RestoreItem(name, "orbax", args=None if handler is None else handler)


def handler_kinds(item_handlers, item_names) -> tuple[dict, bool | None]:
    """(item name -> handler object, default-item mode or None when the first call
    decides) from the constructor's ``item_handlers`` / ``item_names``."""
    if item_handlers is not None and not isinstance(item_handlers, dict):
        return {DEFAULT_ITEM: item_handlers}, True
    handlers = dict(item_handlers or {})
    for name in handlers:
        checkpoint_record.check_item_name(name)
    names = tuple(item_names or ())
    for name in names:
        checkpoint_record.check_item_name(name)
    if handlers or names:
        return handlers, False
    return {}, None


def legacy_handlers(checkpointers, handler_registry):
    """Item name -> handler from Orbax's legacy ``checkpointers`` or a handler registry."""
    if checkpointers is not None:
        if isinstance(checkpointers, dict):
            return {name: getattr(c, "handler", None) or getattr(c, "_handler", None)
                    for name, c in checkpointers.items()}
        return getattr(checkpointers, "handler", None) or ocp.PyTreeCheckpointHandler()
    if handler_registry is not None:
        entries = handler_registry.get_all_entries()
        return {name: handler for (name, _), handler in entries.items() if name}
    return None
