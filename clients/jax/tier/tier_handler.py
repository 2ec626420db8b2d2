"""Orbax's own Standard or PyTree handler of one item, with the daemons' memory in front.

A CheckpointManager's items go through Orbax's composite handler, as in Orbax. For an
item whose handler is Orbax's stock ``StandardCheckpointHandler`` or
``PyTreeCheckpointHandler``, the composite hands out this wrapper instead
(memory_tier.py): a save copies the item into the daemon's memory and has the daemon
write it into the item's folder (the commit future, persist_future.py), a restore
reads it from memory where that gives what Orbax would read. Where the daemon cannot
take the item (away, out of memory, a directory outside its durable tier, a tree the
record cannot hold) or memory cannot give it, the wrapped handler does what it always
does. Everything else (metadata, finalize, its type name in the step's metadata) is the
wrapped handler's, so the step on disk is Orbax's.
"""

from orbax.checkpoint._src import asyncio_utils
from orbax.checkpoint._src.handlers import async_checkpoint_handler


class TierHandler(async_checkpoint_handler.AsyncCheckpointHandler):
    """``inner`` (Orbax's stock handler) of ``item`` of the manager whose tier is ``tier``."""

    def __init__(self, tier, item: str, inner):
        self._tier, self._item, self._inner = tier, item, inner

    async def async_save(self, directory, *args, **kwargs):
        futures = self._tier.save_item(self._item, self._inner, directory,
                                       _args(args, kwargs))
        if futures is None:
            return await self._inner.async_save(directory, *args, **kwargs)
        return futures

    def save(self, directory, *args, **kwargs):
        """Saves and waits until the item is written (Orbax's synchronous save)."""
        for future in asyncio_utils.run_sync(self.async_save(directory, *args, **kwargs)) or []:
            future.result()

    def restore(self, directory, *args, **kwargs):
        restore_args = _args(args, kwargs)
        validate = getattr(self._inner, "_validate_restore_state", None)
        if validate is not None and getattr(restore_args, "item", None) is not None:
            validate(restore_args.item)  # a target Orbax refuses is refused, from any tier
        found = self._tier.restore_item(self._item, directory, restore_args)
        if found is not None:
            return found.value
        return self._inner.restore(directory, *args, **kwargs)

    def metadata(self, directory):
        return self._inner.metadata(directory)

    def finalize(self, directory):
        return self._inner.finalize(directory)

    def close(self):
        return self._inner.close()

    def typestr(self) -> str:
        """The wrapped handler's: the step's metadata names Orbax's handler."""
        return self._inner.typestr()

    def __getattr__(self, name):
        return getattr(self._inner, name)  # whatever else Orbax asks of its handler


def _args(args: tuple, kwargs: dict):
    """The CheckpointArgs of a handler call (Orbax passes ``args=``)."""
    if "args" in kwargs:
        return kwargs["args"]
    return args[0] if args else None
