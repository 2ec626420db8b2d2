"""What a CheckpointManager's step adds to its durable folder, from the step record.

A step saved through bubblesnap's CheckpointManager carries its record
(bubblesnap/checkpoint_record.py). The daemon holding the record's region
writes it as ``.bubblesnap/record.json`` and writes the pytrees' Python
scalars (0-d arrays, as Orbax's ScalarHandler) with its regions; the
finalizer then writes what Orbax's handlers write beside the arrays: each
pytree item's ``_METADATA`` entries (the record's, with the chunk grids the
daemons chose), ``_strings.json`` and ``_sharding``; each JSON item's
``metadata`` file; and copies in the items Orbax's own handlers saved.
"""

import base64
import json
import os
import shutil

import numpy as np

from bubblesnap import checkpoint_record
from bubblesnap.service.durable import format as fmt
from bubblesnap.service.durable import orbax_layout
from bubblesnap.service.durable.sidecar import WrittenRank
from bubblesnap.service.errors import FailedPrecondition

_COMMIT_TEXT = "Checkpoint commit was successful to {}"
#: Orbax's CheckpointManager keeps a step's metrics as this item (JSON file of that name).
METRICS_ITEM = "metrics"
#: Orbax's array metadata key naming a PRNG key's implementation (array_metadata.py).
_KEY_IMPL = "random_key_impl"
#: Python scalars as Orbax's ScalarHandler stores them.
_SCALAR_DTYPES = {"int": np.int64, "float": np.float64, "bool": np.bool_}


def decode(data) -> dict:
    """The step record in ``data`` (its tensor's bytes); FailedPrecondition if it is
    not one, so nothing of the step is written."""
    try:
        return checkpoint_record.decode(data)
    except ValueError as err:
        raise FailedPrecondition(f"the step record is malformed ({err}); not written") from None


def write_record(step_dir: str, record: dict) -> None:
    fmt.write_json(os.path.join(step_dir, fmt.STATE_DIR, fmt.RECORD), record)


def read_record(step_dir: str) -> dict | None:
    """The record the daemon holding it wrote into the step; None for a step of
    bubblesnap's own clients (no record)."""
    path = os.path.join(step_dir, fmt.STATE_DIR, fmt.RECORD)
    if not os.path.exists(path):
        return None
    record = fmt.read_json(path)  # DataLoss when unreadable
    try:
        checkpoint_record.check(record)
    except ValueError as err:
        raise FailedPrecondition(f"{path}: {err}") from None
    return record


def scalars(record: dict) -> list[tuple[str, str, np.ndarray]]:
    """The pytrees' Python scalars as the 0-d arrays Orbax writes for them: (item,
    parameter name, array)."""
    return [(item, leaf.param, np.asarray(leaf.value, _SCALAR_DTYPES[leaf.python_type]))
            for item, entry in record["items"].items() if entry["kind"] == "pytree"
            for leaf in checkpoint_record.leaves(entry, item) if leaf.value_type == "scalar"]


def chunk_grids(written: dict[int, WrittenRank], item: str) -> dict[str, list]:
    """parameter name -> the chunk grid the daemons wrote each array of ``item`` with."""
    return {orbax_layout.param_name(t.key[1:]): list(t.chunks)
            for w in written.values() for t in w.tensors if t.item == item and t.regions}


def item_metadata(entry: dict, chunks: dict, template: dict) -> dict:
    """A pytree item's ``_METADATA``: the record's leaves, each array's write shape the
    chunk grid its daemons wrote with."""
    return {**template, "custom_metadata": entry.get("custom_metadata"), "tree_metadata": {
        leaf.path_key: leaf.metadata(chunks.get(leaf.param))
        for leaf in checkpoint_record.leaves(entry)}}


def write_pytree_extras(folder: str, entry: dict, chunks: dict) -> None:
    """What Orbax's handlers write beside a pytree item's arrays: ``_strings.json``
    (string leaves), ``_sharding`` (arrays' shardings), ``array_metadatas/`` (their
    chunk grids, and each PRNG key's implementation, which Orbax needs to give keys
    back), and the item's commit file."""
    strings, shardings, arrays = {}, {}, []
    for leaf in checkpoint_record.leaves(entry):
        if leaf.value_type == "string":
            strings[leaf.param] = leaf.value
        if leaf.sharding:
            shardings[base64.urlsafe_b64encode(leaf.param.encode()).decode()] = leaf.sharding
        if leaf.value_type == "jax.Array":
            grid = chunks.get(leaf.param, list(leaf.shape))
            arrays.append({"array_metadata": {
                "param_name": leaf.param, "write_shape": grid, "chunk_shape": grid,
                "ext_metadata": {_KEY_IMPL: leaf.key_impl} if leaf.key_impl else None}})
    if strings:
        fmt.write_json(os.path.join(folder, "_strings.json"), strings)
    if shardings:
        fmt.write_json(os.path.join(folder, "_sharding"), shardings)
    if arrays:
        fmt.write_json(os.path.join(folder, "array_metadatas", "process_0"),
                       {"array_metadatas": arrays})
    fmt.write_bytes(os.path.join(folder, "commit_success.txt"),
                    _COMMIT_TEXT.format(folder).encode())


def json_items(record: dict) -> dict:
    """item -> value of the JSON items Orbax's CheckpointManager writes for the step: the
    JSON items, and the metrics as the item ``metrics`` (its reserved name)."""
    found = {item: entry["value"] for item, entry in record["items"].items()
             if entry["kind"] == "json"}
    if record.get("metrics"):
        found[METRICS_ITEM] = record["metrics"]
    return found


def write_items(step_dir: str, record: dict, saved_items: str) -> None:
    """JSON items' files (``metadata``; the reserved item ``metrics``: ``metrics``), and
    the items Orbax's handlers saved, copied in (the manager reads them where it saved
    them until the step has its folder; the writer removes them then)."""
    for item, value in json_items(record).items():
        folder = os.path.join(step_dir, item)
        name = METRICS_ITEM if item == METRICS_ITEM else "metadata"
        fmt.write_bytes(os.path.join(folder, name), json.dumps(value).encode())
        fmt.write_bytes(os.path.join(folder, "commit_success.txt"),
                        _COMMIT_TEXT.format(folder).encode())
    for item, entry in record["items"].items():
        folder = os.path.join(step_dir, item)
        if entry["kind"] == "orbax" and not os.path.isdir(folder):
            source = os.path.join(saved_items, item)
            if not os.path.isdir(source):
                raise FailedPrecondition(f"item {item!r} was saved by its Orbax handler, but "
                                         f"{source} is missing; the step is not finalized")
            copying = f"{folder}.{os.getpid()}.copying"
            shutil.rmtree(copying, ignore_errors=True)
            shutil.copytree(source, copying)
            os.rename(copying, folder)  # whole or absent
