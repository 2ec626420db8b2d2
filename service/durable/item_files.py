"""What Orbax's primary host writes beside a pytree item's arrays, from the item's record.

A CheckpointManager's item travels with its record (bubblesnap/shared/checkpoint_record.py):
the pytree's structure, its Python scalars and strings, each array's sharding. The
daemon holding the record writes, into the item's folder, what Orbax's PyTree handler
writes there beside the arrays: ``_METADATA`` (the tree, each array's write grid the
one its daemons wrote with), the Python scalars (0-d arrays, as Orbax's ScalarHandler
stores them: parts of its own database), ``_strings.json``, ``_sharding``, and each
process's ``array_metadatas/process_<i>`` (the arrays' grids and PRNG key
implementations, the same for every process, as Orbax checks them).
"""

import base64
import json
import posixpath

import numpy as np

from bubblesnap.service.durable import format as fmt
from bubblesnap.service.errors import FailedPrecondition
from bubblesnap.shared import checkpoint_record

#: Orbax's array metadata key naming a PRNG key's implementation (array_metadata.py).
_KEY_IMPL = "random_key_impl"
#: Python scalars as Orbax's ScalarHandler stores them.
_SCALAR_DTYPES = {"int": np.int64, "float": np.float64, "bool": np.bool_}


def decode(data) -> dict:
    """The item record in ``data`` (its tensor's bytes); FailedPrecondition if it is not
    one, so nothing of the item is written."""
    try:
        record = checkpoint_record.decode(data)
    except ValueError as err:
        raise FailedPrecondition(f"the item record is malformed ({err}); not written") from None
    if len(record["items"]) != 1 or next(iter(record["items"].values()))["kind"] != "pytree":
        raise FailedPrecondition("an item record names one pytree item; not written")
    return record


def entry(record: dict) -> dict:
    """The record's one pytree item."""
    return next(iter(record["items"].values()))


def scalars(record: dict) -> list[tuple[str, np.ndarray]]:
    """The item's Python scalars as the 0-d arrays Orbax writes for them: (parameter
    name, array)."""
    return [(leaf.param, np.asarray(leaf.value, _SCALAR_DTYPES[leaf.python_type]))
            for leaf in checkpoint_record.leaves(entry(record))
            if leaf.value_type == "scalar"]


def write(folder: str, record: dict, grids: dict, template: dict, world_size: int) -> None:
    """Writes the item's files beside its arrays into ``folder``. ``grids``: parameter
    name -> the chunk grid its daemons write it with; ``template``: Orbax's ``_METADATA``
    with no leaves; ``world_size``: the processes whose ``array_metadatas`` Orbax reads."""
    item = entry(record)
    leaves = checkpoint_record.leaves(item)
    metadata = {**template, "custom_metadata": item.get("custom_metadata"), "tree_metadata": {
        leaf.path_key: leaf.metadata(grids.get(leaf.param)) for leaf in leaves}}
    fmt.write_bytes(posixpath.join(folder, "_METADATA"), json.dumps(metadata).encode())
    strings, shardings, arrays = {}, {}, []
    for leaf in leaves:
        if leaf.value_type == "string":
            strings[leaf.param] = leaf.value
        if leaf.sharding:
            shardings[base64.urlsafe_b64encode(leaf.param.encode()).decode()] = leaf.sharding
        if leaf.value_type == "jax.Array":
            grid = list(grids.get(leaf.param, leaf.shape))
            arrays.append({"array_metadata": {
                "param_name": leaf.param, "write_shape": grid, "chunk_shape": grid,
                "ext_metadata": {_KEY_IMPL: leaf.key_impl} if leaf.key_impl else None}})
    if strings:
        fmt.write_json(posixpath.join(folder, "_strings.json"), strings)
    if shardings:
        fmt.write_json(posixpath.join(folder, "_sharding"), shardings)
    if arrays:
        for process in range(world_size):
            fmt.write_json(posixpath.join(folder, "array_metadatas", f"process_{process}"),
                           {"array_metadatas": arrays})
