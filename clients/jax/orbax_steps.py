"""The manager's directory as Orbax lays it out: step folders, their metadata, the
items Orbax's own handlers save, and the steps plain Orbax wrote before the switch.

``<directory>/<step folder>/`` is a step as Orbax's CheckpointManager writes
it (``<prefix>_<step>`` or the bare number, ``<item>/`` folders,
``_CHECKPOINT_METADATA``). The daemon writes the steps it persists there
(``.bubblesnap/complete.json`` marks one whole); Orbax may have written
others. Items no daemon can hold in memory (:data:`checkpoint_items` kind
``orbax``) are saved here by Orbax's own handler, before the daemon knows of
the step: into ``<directory>/.bubblesnap/items/<step>/<item>``, which the
daemon moves into the step's folder when it persists the step.
"""

import json
import logging
import os
import shutil
import uuid

import grpc
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_manager as orbax_manager

from bubblesnap import checkpoint_record
from bubblesnap.protos import daemon_pb2 as pb

log = logging.getLogger("bubblesnap.client")

#: The daemon's marker of a whole step it wrote (service/durable/format.py).
MARKER = os.path.join(checkpoint_record.STATE_DIR, checkpoint_record.MARKER_FILE)
RECORD = os.path.join(checkpoint_record.STATE_DIR, checkpoint_record.RECORD_FILE)
ITEMS_DIR = checkpoint_record.ITEMS_DIR
ROOT_METADATA = os.path.join("metadata", "_ROOT_METADATA")


class StepFolders:
    """The step folders of one manager's ``directory``."""

    def __init__(self, directory: str, prefix: str | None, fixed_length: int | None,
                 name_format=None):
        self.directory = directory
        self.prefix, self.fixed_length = prefix, fixed_length
        self._name_format = name_format or ocp.step.standard_name_format(
            step_prefix=prefix, step_format_fixed_length=fixed_length)
        self._orbax_manager = None

    def path(self, step: int) -> str:
        """Where ``step``'s folder is (the one found on disk, else the one the daemon
        makes)."""
        found = self.find().get(step)
        return found if found is not None else os.path.join(
            self.directory, checkpoint_record.step_dir_name(step, self.prefix,
                                                            self.fixed_length))

    def find(self) -> dict[int, str]:
        """step -> folder of every whole step on disk: the daemon's (marked) and the ones
        Orbax committed (found by Orbax's own name format, unfinished ones skipped)."""
        found = {}
        try:
            metadatas = list(self._name_format.find_all(self.directory))
        except (FileNotFoundError, NotADirectoryError):
            return found
        for metadata in metadatas:
            path = str(metadata.path)
            if self.is_ours(path) or os.path.exists(os.path.join(path, "_CHECKPOINT_METADATA")):
                found[metadata.step] = path
        return found

    @staticmethod
    def is_ours(path: str) -> bool:
        """Whether the folder is a step the daemon wrote whole."""
        return os.path.exists(os.path.join(path, MARKER))

    @staticmethod
    def record(path: str) -> dict:
        """The step record of a step the daemon wrote (its ``.bubblesnap/record.json``)."""
        with open(os.path.join(path, RECORD)) as f:
            found = json.load(f)
        checkpoint_record.check(found)
        return found

    def being_written(self) -> set[int]:
        """Steps the daemons are writing (or renaming) into this directory."""
        partial = os.path.join(self.directory, checkpoint_record.PARTIAL_DIR)
        return {int(n) for n in _listdir(partial) if n.isdigit()}

    @staticmethod
    def metadata_at(path: str) -> dict | None:
        """The ``_CHECKPOINT_METADATA`` of the step folder ``path`` (item handlers, metrics,
        custom metadata, timestamps); None when it has no readable one."""
        try:
            with open(os.path.join(path, "_CHECKPOINT_METADATA")) as f:
                found = json.load(f)
        except (OSError, ValueError):
            return None
        return found if isinstance(found, dict) else None

    # -- items saved by Orbax's own handlers ------------------------------------

    def item_path(self, step: int, item: str) -> str:
        """Where an item Orbax's handler saved is: in the step's folder once the daemon
        persisted the step, else where the manager saved it."""
        final = self.find().get(step)
        if final is not None and os.path.isdir(os.path.join(final, item)):
            return os.path.join(final, item)
        return os.path.join(self.directory, ITEMS_DIR, str(step), item)

    def save_item(self, step: int, item: str, args) -> None:
        """Saves an item with the Orbax handler its args are registered with (every
        process calls it, as Orbax's own save; the handler decides who writes)."""
        path = epath.Path(self.directory) / ITEMS_DIR / str(step) / item
        if path.exists():  # an earlier try at this step (a restarted run)
            shutil.rmtree(path, ignore_errors=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = ocp.args.get_registered_handler_cls(args)()
        with ocp.Checkpointer(handler) as checkpointer:
            checkpointer.save(path, args=args)

    def restore_item(self, step: int, item: str, args, handler=None):
        """Restores an item Orbax's handler saved (``args`` None: the handler's defaults)."""
        if handler is None:
            handler = ocp.args.get_registered_handler_cls(args)()
        path = self.item_path(step, item)
        with ocp.Checkpointer(handler) as checkpointer:
            try:
                return checkpointer.restore(epath.Path(path), args=args)
            except Exception:
                # The daemon published the step while it was read here: it removes the
                # saved copy once the step's folder holds the item. Orbax's handlers
                # fail on vanished files in their own ways (tensorstore: ValueError).
                moved = self.item_path(step, item)
                if moved == path:
                    raise
                return checkpointer.restore(epath.Path(moved), args=args)

    def forget_items(self, keep) -> None:
        """Removes saved items of steps not in ``keep`` (deleted, or persisted by the
        daemon, which moved them into their step's folder)."""
        base = os.path.join(self.directory, ITEMS_DIR)
        for name in _listdir(base):
            if name.isdigit() and int(name) not in keep:
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)

    # -- steps Orbax wrote ------------------------------------------------------

    def restore_with_orbax(self, step: int, args, item_names, item_handlers):
        """Restores a step plain Orbax wrote (no daemon knows it), through Orbax's own
        CheckpointManager over this directory, read only."""
        return self._orbax(item_names, item_handlers).restore(step, args=args)

    def metadata_with_orbax(self, step: int, item_names, item_handlers):
        """Orbax's StepMetadata of a step plain Orbax wrote."""
        return self._orbax(item_names, item_handlers).metadata(step)

    def _orbax(self, item_names, item_handlers):
        if self._orbax_manager is None:
            self._orbax_manager = orbax_manager.CheckpointManager(  # Orbax's own, even patched
                self.directory, item_names=item_names or None,
                item_handlers=item_handlers or None,
                options=ocp.CheckpointManagerOptions(
                    read_only=True, step_prefix=self.prefix,
                    step_format_fixed_length=self.fixed_length,
                    step_name_format=self._name_format))
        return self._orbax_manager

    def close(self) -> None:
        if self._orbax_manager is not None:
            self._orbax_manager.close()
            self._orbax_manager = None

    def check_daemon(self, client, address: str) -> None:
        """Warns when the daemon's durable tier is not where ``directory`` says: the
        steps would be written, and plain Orbax would find them, elsewhere. A
        warning, not an error: a container may mount the same folder elsewhere."""
        try:
            durable = client.session.call("Status", pb.StatusRequest()).durable_directory
        except grpc.RpcError:
            return  # no daemon yet: saves say so, each in its SnapshotResult
        parent = os.path.dirname(self.directory)
        if not durable:
            log.warning("the daemon at %s has no durable tier (--durable-dir): steps live "
                        "only in memory, nothing is written to %s", address, self.directory)
        elif os.path.realpath(durable) != os.path.realpath(parent):
            log.warning("the daemon writes durable steps to %s/%s, not to %s (its "
                        "--durable-dir is not %s)", durable, client.job, self.directory,
                        parent)

    # -- deleting and root metadata ---------------------------------------------

    def delete(self, step: int) -> None:
        """Removes the step's folder (renamed aside first, so no reader sees half of it)
        and the items saved for it; a tombstone tells the daemons not to publish a write
        of the step still under way."""
        tombstone = os.path.join(self.directory, checkpoint_record.DELETED_DIR, str(step))
        os.makedirs(os.path.dirname(tombstone), exist_ok=True)
        with open(tombstone, "w"):
            pass
        path = os.path.join(self.directory, checkpoint_record.step_dir_name(
            step, self.prefix, self.fixed_length))  # no listing: a delete per few saves
        if os.path.isdir(path):
            aside = os.path.join(self.directory, checkpoint_record.STATE_DIR,
                                 f"deleting-{uuid.uuid4().hex}")
            os.makedirs(os.path.dirname(aside), exist_ok=True)
            try:
                os.rename(path, aside)
            except OSError as err:
                log.warning("could not delete step %d at %s: %s", step, path, err)
                return
            shutil.rmtree(aside, ignore_errors=True)
        shutil.rmtree(os.path.join(self.directory, ITEMS_DIR, str(step)), ignore_errors=True)

    def prepare(self, create: bool, writer: bool) -> None:
        """Makes the directory if it is missing and ``create`` (else FileNotFoundError,
        as Orbax's ``create=False``); ``writer`` (the primary, not read-only) also
        removes what an interrupted delete left behind."""
        if not os.path.isdir(self.directory):
            if not create:
                raise FileNotFoundError(f"{self.directory} does not exist (create=False)")
            if writer:
                os.makedirs(self.directory, exist_ok=True)
        if not writer:
            return
        state = os.path.join(self.directory, checkpoint_record.STATE_DIR)
        for name in _listdir(state):
            if name.startswith("deleting-"):
                shutil.rmtree(os.path.join(state, name), ignore_errors=True)

    def write_root_metadata(self, custom_metadata: dict) -> None:
        """Orbax's ``metadata/_ROOT_METADATA``, written once: a later run keeps the first."""
        path = os.path.join(self.directory, ROOT_METADATA)
        if os.path.exists(path):
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(temporary, "w") as f:
            json.dump({"internal_metadata": {}, "custom_metadata": dict(custom_metadata)}, f)
        os.replace(temporary, path)

    def root_metadata(self) -> dict:
        try:
            with open(os.path.join(self.directory, ROOT_METADATA)) as f:
                found = json.load(f)
        except (OSError, ValueError):
            return {}
        return found.get("custom_metadata") or {} if isinstance(found, dict) else {}


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
