"""``metadata(step)`` as Orbax answers it, from a step's record (any tier) or its folder.

A step the daemon holds has its record (checkpoint_record.py): the items and
their handlers, the metrics and custom metadata saved with it, and each
pytree item's leaves (names, shapes, dtypes, shardings), which become
Orbax's ``StepMetadata`` with the same ``TreeMetadata`` of ``ArrayMetadata``
/ ``ScalarMetadata`` / ``StringMetadata`` leaves Orbax reads from
``_METADATA`` (a JSON item's metadata is None, as in Orbax). A step Orbax
wrote is read by Orbax itself.
"""

import datetime
import os

import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint._src.metadata import checkpoint as checkpoint_metadata
from orbax.checkpoint._src.metadata import empty_values
from orbax.checkpoint._src.metadata import sharding as sharding_metadata
from orbax.checkpoint._src.metadata import tree as tree_metadata
from orbax.checkpoint._src.metadata.pytree_metadata_options import PYTREE_METADATA_OPTIONS
from orbax.checkpoint._src.tree import utils as tree_utils

from bubblesnap import checkpoint_record
from bubblesnap.clients.jax import checkpoint_tree


def step_time(record: dict) -> datetime.datetime:
    """When the step was saved (UTC), as Orbax's checkpoint infos have it."""
    return datetime.datetime.fromtimestamp(float(record.get("time", 0.0)),
                                           tz=datetime.timezone.utc)


def from_record(record: dict, step_dir: str, single: bool) -> ocp.metadata.StepMetadata:
    """The StepMetadata of the step whose record is ``record`` (its folder
    ``step_dir``, which need not exist for a step held only in memory)."""
    items = record["items"]
    handlers = {name: entry["handler"] for name, entry in items.items()}
    metadata = {name: _item_metadata(entry, os.path.join(step_dir, name))
                for name, entry in items.items()}
    nanos = int(float(record.get("time", 0.0)) * 1e9)
    if single and list(items) == ["default"]:
        item_handlers, item_metadata = handlers["default"], metadata["default"]
    else:
        item_handlers = handlers
        item_metadata = checkpoint_metadata.CompositeItemMetadata(**metadata)
    return ocp.metadata.StepMetadata(
        item_handlers=item_handlers, item_metadata=item_metadata,
        metrics=dict(record.get("metrics") or {}), init_timestamp_nsecs=nanos,
        commit_timestamp_nsecs=nanos, custom_metadata=dict(record.get("custom_metadata") or {}))


def _item_metadata(entry: dict, directory: str):
    if entry["kind"] != "pytree":
        return None
    path = epath.Path(directory)
    leaves = [(checkpoint_tree.keypath_of(leaf), _leaf_metadata(leaf, path))
              for leaf in checkpoint_record.leaves(entry)]
    return tree_metadata.TreeMetadata.build(tree_utils.from_flattened_with_keypath(leaves),
                                            custom_metadata=entry.get("custom_metadata"))


def _leaf_metadata(leaf, directory):
    if leaf.is_array:
        sharding = None
        if leaf.sharding:
            sharding = sharding_metadata.from_serialized_string(leaf.sharding)
        return ocp.metadata.ArrayMetadata(
            name=leaf.param, directory=directory, shape=leaf.shape, sharding=sharding,
            dtype=np.dtype(checkpoint_tree.numpy_dtype(leaf.dtype)),
            storage=ocp.metadata.StorageMetadata(chunk_shape=leaf.shape,
                                                 write_shape=leaf.shape))
    if leaf.value_type == checkpoint_tree.SCALAR:
        dtype = {"int": np.int64, "float": np.float64, "bool": np.bool_}[leaf.python_type]
        return ocp.metadata.ScalarMetadata(name=leaf.param, directory=directory,
                                           dtype=np.dtype(dtype))
    if leaf.value_type == checkpoint_tree.STRING:
        return ocp.metadata.StringMetadata(name=leaf.param, directory=directory)
    return empty_values.get_empty_value_from_typestr(leaf.value_type, PYTREE_METADATA_OPTIONS)
