"""The Orbax side of a step's checkpoint: a rank's regions written, a region read, the
step finalized, all through Orbax's own TensorStore specs and metadata code.

A daemon writes like one process of an Orbax multi-process save: into its
own OCDBT database ``ocdbt.process_<rank>`` (``ArrayWriteSpec`` with that
process id), each array opened with the metadata Orbax would write and only
its regions written, straight from the views it is given. Finalizing is
Orbax's finalize: ``merge_ocdbt_per_process_files``, then ``_METADATA``
(``InternalTreeMetadata``) and ``_CHECKPOINT_METADATA`` (``StepMetadata``).
No daemon shares a jax.distributed runtime with another, so these are the
pieces of Orbax's save below the handler, not the handler itself.
"""

import asyncio
import dataclasses
import json
import time

import numpy as np

from bubblesnap.service.durable import format as fmt
from bubblesnap.service.durable import orbax_layout
from bubblesnap.service.durable.sidecar import FORMAT, WrittenRank
from bubblesnap.service.errors import FailedPrecondition

#: Bytes of regions handed to TensorStore before waiting for them: TensorStore copies
#: what it is given until it is written, so this bounds the copy, not the state.
_WRITE_BYTES_IN_FLIGHT = 256 << 20
#: The value type Orbax records for a jax.Array leaf: restored as a jax.Array into
#: the caller's shardings, or as numpy without a target.
_VALUE_TYPE = "jax.Array"
_COMMIT_TEXT = "Checkpoint commit was successful to {}"


@dataclasses.dataclass(frozen=True)
class ArrayPart:
    """What one rank writes of one array: ``regions`` are (box, array of the box)."""

    param: str
    dtype: str
    shape: tuple[int, ...]
    write_shape: tuple[int, ...]
    regions: tuple[tuple[orbax_layout.Box, np.ndarray], ...]


def _orbax_modules():
    fmt.orbax()  # the ImportError that says what to install
    from orbax.checkpoint._src.serialization import ocdbt_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    return ts_utils, ocdbt_utils


def context():
    """A TensorStore context as Orbax makes it for OCDBT (I/O threads, node cache)."""
    ts_utils, _ = _orbax_modules()
    return ts_utils.get_ts_context(use_ocdbt=True)


def write_parts(step_dir: str, rank: int, parts: list[ArrayPart]) -> dict[str, tuple]:
    """Writes ``parts`` into ``rank``'s database of the step; returns each array's
    chunks once every region is durable. FailedPrecondition, before anything is
    written, if a region is not whole chunks (another daemon could write into
    the same chunk)."""
    import tensorstore as ts

    specs, chunks = {}, {}
    for part in parts:
        spec = _write_spec(step_dir, rank, part)
        chunks[part.param] = tuple(spec.metadata.chunk_shape)
        for box, _ in part.regions:
            if not orbax_layout.is_aligned(box, part.shape, chunks[part.param]):
                raise FailedPrecondition(
                    f"region {box} of {part.param!r} is not whole chunks of "
                    f"{chunks[part.param]}; not written")
        specs[part.param] = spec
    batch = _Batch(ts, context())
    for part in parts:
        array = batch.open(specs[part.param].json)
        for box, data in part.regions:
            batch.write(array, box, data)
    batch.commit()
    return chunks


class _Batch:
    """Region writes committed together, a transaction at a time: one database
    commit (a few files) per batch instead of one per region, and TensorStore's
    copy of what a batch holds bounded by ``_WRITE_BYTES_IN_FLIGHT``."""

    def __init__(self, ts, ctx):
        self._ts, self._ctx = ts, ctx
        self._txn, self._bytes, self._writes = ts.Transaction(), 0, []

    def open(self, spec: dict):
        """Creates the array's metadata in this database (in the batch): every writer of
        an array does, as Orbax's primary host does in its own; the merge finds one
        identical copy per writer."""
        return self._ts.open(self._ts.Spec(spec), create=True, open=True, context=self._ctx,
                             transaction=self._txn).result()

    def write(self, array, box, data: np.ndarray) -> None:
        if array.transaction is not self._txn:  # opened in a batch committed since
            array = array.with_transaction(self._txn)
        self._writes.append(array[tuple(slice(a, b) for a, b in box)].write(data))
        self._bytes += data.nbytes
        if self._bytes >= _WRITE_BYTES_IN_FLIGHT:
            self.commit()

    def commit(self) -> None:
        for write in self._writes:
            write.result()  # copied into the transaction
        # Durable once committed: TensorStore's file driver fsyncs (file_io_sync, on by default).
        self._txn.commit_async().result()
        self._txn, self._bytes, self._writes = self._ts.Transaction(), 0, []


def _write_spec(step_dir: str, rank: int, part: ArrayPart):
    ts_utils, _ = _orbax_modules()
    return ts_utils.ArrayWriteSpec(
        step_dir, part.param, global_shape=part.shape, write_shape=part.write_shape,
        dtype=fmt.numpy_dtype(part.dtype), use_ocdbt=True, process_id=rank)


def open_array(step_dir: str, param: str, ctx):
    """The array ``param`` of a finalized step, opened for reading as Orbax opens it."""
    return start_open(step_dir, param, ctx).result()


def start_open(step_dir: str, param: str, ctx):
    """Starts opening ``param`` as :func:`open_array` does; the future of the array (opens
    started together overlap, as Orbax's do)."""
    import tensorstore as ts

    ts_utils, _ = _orbax_modules()
    spec = ts_utils.ArrayReadSpec(step_dir, param, use_zarr3=False, use_ocdbt=True)
    return ts.open(ts.Spec(spec.json), open=True, context=ctx)


def read_box(array, box: orbax_layout.Box) -> np.ndarray:
    """The C-ordered elements of ``box`` of an opened array (a region read)."""
    return np.ascontiguousarray(array[tuple(slice(a, b) for a, b in box)].read().result())


def read_box_into(array, box: orbax_layout.Box, out: np.ndarray):
    """Starts reading ``box`` of an opened array straight into ``out`` (C order, the box's
    shape and the array's dtype: a slot of a segment); the future of the read."""
    import tensorstore as ts

    target = ts.array(out, copy=False, write=True)
    return target.write(array[tuple(slice(a, b) for a, b in box)])


def finalize(step_dir: str, written: dict[int, WrittenRank], finalizer: int) -> None:
    """Makes the step one Orbax checkpoint: merges the ranks' databases, writes Orbax's
    metadata files, then the completion marker (each file atomically).

    ``written`` must be whole (policy.incomplete). Two daemons finalizing at
    once write the same keys and the same files: the second changes nothing.
    """
    ts_utils, ocdbt_utils = _orbax_modules()
    from etils import epath

    started = time.time_ns()
    for rank in set(fmt.child_ranks(step_dir)) - set(written):
        fmt.remove(fmt.child_path(step_dir, rank))  # an earlier run's, never to be merged
    path = epath.Path(step_dir)
    asyncio.run(ocdbt_utils.merge_ocdbt_per_process_files(
        path, ts_context=ts_utils.get_ts_context(use_ocdbt=True), use_zarr3=False))
    fmt.write_bytes(f"{step_dir}/_METADATA", json.dumps(_tree_metadata(path, written)).encode())
    fmt.write_bytes(f"{step_dir}/_CHECKPOINT_METADATA",
                    json.dumps(_step_metadata(started)).encode())
    fmt.write_bytes(f"{step_dir}/commit_success.txt", _COMMIT_TEXT.format(step_dir).encode())
    world = next(iter(written.values())).world_size
    fmt.write_json(fmt.marker_path(step_dir), {
        "format": FORMAT, "world_size": world, "ranks": sorted(written),
        "finalized_by": finalizer})


def _tree_metadata(path, written: dict[int, WrittenRank]) -> dict:
    """Orbax's ``_METADATA``: the tree of every leaf written, each a jax.Array."""
    from orbax.checkpoint._src.metadata import tree as tree_metadata
    from orbax.checkpoint._src.serialization import types

    ctx = context()
    tree: dict = {}
    for w in written.values():
        for t in w.tensors:
            if t.job_wide and not t.regions:
                continue  # listed by a rank that copies none of it; written by others
            node = tree
            for part in t.key[:-1]:
                node = node.setdefault(part, {})
            node[t.key[-1]] = types.ParamInfo(
                name=orbax_layout.param_name(t.key), parent_dir=path, ts_context=ctx,
                value_typestr=_VALUE_TYPE, write_shape=t.chunks)
    return tree_metadata.InternalTreeMetadata.build(tree, use_ocdbt=True,
                                                    use_zarr3=False).to_json()


def _step_metadata(started_ns: int) -> dict:
    """Orbax's ``_CHECKPOINT_METADATA``, naming the handler that reads the step."""
    ocp = fmt.orbax()
    from orbax.checkpoint._src.metadata import checkpoint as checkpoint_metadata
    from orbax.checkpoint._src.metadata import step_metadata_serialization

    return step_metadata_serialization.serialize(checkpoint_metadata.StepMetadata(
        item_handlers=ocp.StandardCheckpointHandler.typestr(), init_timestamp_nsecs=started_ns,
        commit_timestamp_nsecs=time.time_ns()))
