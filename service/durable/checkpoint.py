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

Orbax builds TensorStore specs for absolute paths and ``gs://`` only. A folder in an
object store (storage/) is named to Orbax by a stand-in absolute path, and the file
kvstores of the spec Orbax builds are replaced by the storage's own (``_placed``): the
same arrays, metadata and OCDBT databases, on S3 with its endpoint, or on GCS.
"""

import asyncio
import dataclasses
import json
import time

import numpy as np

from bubblesnap.service.durable import format as fmt
from bubblesnap.service.durable import orbax_layout, policy, storage
from bubblesnap.service.durable.sidecar import FORMAT, WrittenRank
from bubblesnap.service.errors import FailedPrecondition

#: The most bytes of one chunk (``orbax_layout.chunk_shape``: chunks divide the write
#: grid, so every region stays whole chunks). A restore reads a chunk into buffers of
#: TensorStore's own, the file's bytes and then the decoded ones; past glibc's 32 MiB
#: they are mapped afresh and zeroed for each chunk. A shard per chunk (Orbax's default)
#: read 2 GB from tmpfs in 1666 ms on the dev VM, 16 MiB chunks in 1080 ms (4-32 MiB
#: alike at 1 GB).
CHUNK_BYTES = 16 << 20
#: Chunks are not cut below this: an axis whose divisors allow no more is left whole.
CHUNK_LEAST_BYTES = 1 << 20
#: A region is handed over in pieces of whole chunks of at most this much (one chunk
#: row at least): a shard of many GB would otherwise be copied whole before any of it
#: is written (a 4096 MB state of 48 shards on the dev VM: the writing daemon's peak
#: RSS passed what it held by 1.57 GB with whole shards, by 1.21 GB in 64 MB pieces).
#: One chunk: a batch passes its bound by at most a chunk row.
_WRITE_PIECE_BYTES = CHUNK_BYTES
#: The value type Orbax records for a jax.Array leaf: restored as a jax.Array into
#: the caller's shardings, or as numpy without a target.
_VALUE_TYPE = "jax.Array"
_COMMIT_TEXT = "Checkpoint commit was successful to {}"
#: TensorStore's retries of an object store's requests (about 40 s in all).
_RETRIES = {"max_retries": 8, "initial_delay": "0.2s", "max_delay": "8s"}
#: The absolute path an object store's folder is named by to Orbax's spec builders.
_STAND_IN = "/bubblesnap-object-store"


@dataclasses.dataclass(frozen=True)
class ArrayPart:
    """What one rank writes of one array: ``regions`` are (box, array of the box)."""

    param: str
    dtype: str
    shape: tuple[int, ...]
    write_shape: tuple[int, ...]
    regions: tuple[tuple[orbax_layout.Box, np.ndarray], ...]


def chunk_grid(write_shape: tuple[int, ...], dtype: str) -> tuple[int, ...]:
    """The chunks an array whose write grid's cell is ``write_shape`` is written in (its
    zarr chunk shape: Orbax's own chunk_byte_size cuts the largest axis first, to a chunk
    of a few bytes for a prime length)."""
    return orbax_layout.chunk_shape(write_shape, fmt.numpy_dtype(dtype).itemsize,
                                    CHUNK_BYTES, CHUNK_LEAST_BYTES)


def _orbax_modules():
    fmt.orbax()  # the ImportError that says what to install
    from orbax.checkpoint._src.serialization import ocdbt_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    return ts_utils, ocdbt_utils


def context():
    """A TensorStore context as Orbax makes it for OCDBT (I/O threads, node cache), with
    an object store's retries bounded as obstore's are (object_config): TensorStore's
    own back off for minutes, holding the writer's thread on a store that is down."""
    import tensorstore as ts

    ts_utils, _ = _orbax_modules()
    return ts.Context(ts.Context.Spec({name: _RETRIES for name in (
        "s3_request_retries", "gcs_request_retries")}),
        parent=ts_utils.get_ts_context(use_ocdbt=True))


def write_parts(folder: str, rank: int, parts: list[ArrayPart], batch_bytes: int,
                written=None, *, compression: str = "none") -> dict[str, tuple]:
    """Writes ``parts`` into ``rank``'s database of the checkpoint in ``folder``; returns
    each array's chunks, by parameter, once every region is durable, committed
    ``batch_bytes`` (DurableOptions.write_batch_bytes) at a time, each chunk
    compressed as ``compression`` says (a key of ``policy.COMPRESSORS``; the zarr
    metadata records it, so Orbax reads either).
    FailedPrecondition, before anything is written, if a region is not
    whole chunks (another daemon could write into the same chunk).
    ``written(nbytes)`` hears each region as TensorStore took its bytes (from
    TensorStore's threads)."""
    import tensorstore as ts

    specs, chunks = {}, {}
    for part in parts:
        spec = _write_spec(folder, rank, part)
        chunks[part.param] = tuple(spec.metadata.chunk_shape)
        for box, _ in part.regions:
            if not orbax_layout.is_aligned(box, part.shape, chunks[part.param]):
                raise FailedPrecondition(
                    f"region {box} of {part.param!r} is not whole chunks of "
                    f"{chunks[part.param]}; not written")
        written_as = spec.json
        specs[part.param] = written_as | {"metadata": {
            **written_as["metadata"], "compressor": policy.COMPRESSORS[compression]}}
    batch = _Batch(ts, context(), batch_bytes, written)
    for part in parts:
        array = batch.open(_placed(specs[part.param]))
        itemsize = fmt.numpy_dtype(part.dtype).itemsize
        for box, data in part.regions:
            for piece in orbax_layout.row_pieces(box, chunks[part.param], itemsize,
                                                 _WRITE_PIECE_BYTES):
                batch.write(array, piece, data[orbax_layout.rows_of(box, piece)])
    batch.commit()
    return chunks


class _Batch:
    """Region writes committed together, a transaction at a time: one database
    commit (a few files) per batch instead of one per region, and TensorStore's
    copy of what a batch holds bounded by ``most_bytes``."""

    def __init__(self, ts, ctx, most_bytes: int, written=None):
        self._ts, self._ctx, self._written, self._most = ts, ctx, written, most_bytes
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
        if self._written is not None:
            self._writes[-1].add_done_callback(lambda _, n=data.nbytes: self._written(n))
        self._bytes += data.nbytes
        if self._bytes >= self._most:
            self.commit()

    def commit(self) -> None:
        for write in self._writes:
            write.result()  # copied into the transaction
        # Durable once committed: TensorStore's file driver fsyncs (file_io_sync, on by default).
        self._txn.commit_async().result()
        self._txn, self._bytes, self._writes = self._ts.Transaction(), 0, []


def _write_spec(folder: str, rank: int, part: ArrayPart):
    ts_utils, _ = _orbax_modules()
    return ts_utils.ArrayWriteSpec(
        _orbax_path(folder), part.param, global_shape=part.shape, dtype=fmt.numpy_dtype(part.dtype),
        use_ocdbt=True, write_shape=chunk_grid(part.write_shape, part.dtype),
        process_id=rank)


def open_array(step_dir: str, param: str, ctx):
    """The array ``param`` of a finalized step being opened for reading as Orbax opens
    it: a TensorStore future (``.result()`` is the array), so that many open at once."""
    import tensorstore as ts

    ts_utils, _ = _orbax_modules()
    spec = ts_utils.ArrayReadSpec(_orbax_path(step_dir), param, use_zarr3=False,
                                  use_ocdbt=True)
    return ts.open(ts.Spec(_placed(spec.json)), open=True, context=ctx)


def read_box(array, box: orbax_layout.Box, into: np.ndarray):
    """The elements of ``box`` of an opened array being read straight into ``into`` (a
    writable uint8 view of the box's C-order bytes, e.g. in the segment that will be
    served), with no array in between: a future, None once they are there, so that
    the reads of a restore run at once on TensorStore's threads."""
    import tensorstore as ts

    region = array[tuple(slice(a, b) for a, b in box)]
    target = into.view(array.dtype.numpy_dtype).reshape(tuple(b - a for a, b in box))
    return ts.array(target, copy=False, write=True).write(region)


def finalize(step_dir: str, written: dict[int, WrittenRank], finalizer: int) -> None:
    """Makes the step one Orbax checkpoint: merges the ranks' databases, writes Orbax's
    metadata files, then the completion marker (each file atomically).

    ``written`` must be whole (policy.incomplete). Two daemons finalizing at
    once write the same keys and the same files: the second changes nothing.
    """
    from etils import epath

    started = time.time_ns()
    for rank in set(fmt.child_ranks(step_dir)) - set(written):
        fmt.remove(fmt.child_path(step_dir, rank))  # an earlier run's, never to be merged
    asyncio.run(_merge(step_dir, sorted(written)))
    path = epath.Path(_orbax_path(step_dir))  # names the arrays' folder in the metadata
    fmt.write_bytes(f"{step_dir}/_METADATA", json.dumps(_tree_metadata(path, written)).encode())
    fmt.write_bytes(f"{step_dir}/_CHECKPOINT_METADATA",
                    json.dumps(_step_metadata(started)).encode())
    fmt.write_bytes(f"{step_dir}/commit_success.txt", _COMMIT_TEXT.format(step_dir).encode())
    world = next(iter(written.values())).world_size
    fmt.write_json(fmt.marker_path(step_dir), {
        "format": FORMAT, "world_size": world, "ranks": sorted(written),
        "finalized_by": finalizer, "step": next(iter(written.values())).step})


async def _merge(step_dir: str, ranks: list[int]) -> None:
    """Orbax's ``merge_ocdbt_per_process_files`` over the databases of ``ranks``: the
    step's root database made to reference every rank's keys (one atomic commit),
    then its params checked as Orbax checks them."""
    ts_utils, ocdbt_utils = _orbax_modules()
    ctx = context()
    children = [ts_utils.open_kv_store(_placed(ts_utils.build_kvstore_tspec(
        _orbax_path(fmt.child_path(step_dir, rank)), use_ocdbt=True)), ctx) for rank in ranks]
    parent = ts_utils.open_kv_store(_placed(ts_utils.build_kvstore_tspec(
        _orbax_path(step_dir), use_ocdbt=True,
        ocdbt_write_options=ts_utils.OcdbtKvStoreWriteOptions(
            mode=ts_utils.OcdbtWriteMode.MERGE))), ctx)
    *opened, root = await asyncio.gather(*children, parent)
    import tensorstore as ts

    txn = ts.Transaction(atomic=True)
    await asyncio.gather(*(child.experimental_copy_range_to(root.with_transaction(txn))
                           for child in opened))
    await ocdbt_utils._validate_params(root.with_transaction(txn), use_zarr3=False)
    await txn.commit_async()


def _orbax_path(folder: str) -> str:
    """The path Orbax's spec builders are given for ``folder``: itself, or for an object
    store's folder its stand-in (``_placed`` swaps it back)."""
    if not storage.is_url(folder):
        return folder
    return f"{_STAND_IN}/{folder.replace('://', '/', 1)}"


def _placed(spec):
    """``spec`` with each file kvstore of a stand-in path replaced by the object
    store's kvstore of that folder."""
    if isinstance(spec, list):
        return [_placed(v) for v in spec]
    if not isinstance(spec, dict):
        return spec
    path = spec.get("path", "")
    if spec.get("driver") == "file" and path.startswith(_STAND_IN + "/"):
        url = path[len(_STAND_IN) + 1:].replace("/", "://", 1)
        return storage.at(url).kvstore(url)
    return {key: _placed(value) for key, value in spec.items()}


def _tree_metadata(path, written: dict[int, WrittenRank]) -> dict:
    """Orbax's ``_METADATA``: the tree of every leaf written, each a jax.Array."""
    from orbax.checkpoint._src.metadata import tree as tree_metadata
    from orbax.checkpoint._src.serialization import types

    ctx = context()
    tree: dict = {}
    for w in written.values():
        for t in w.tensors:
            if t.job_wide and not t.regions:
                continue  # listed by a rank that copies none of it
            node = tree
            for part in t.key[:-1]:
                node = node.setdefault(part, {})
            node[t.key[-1]] = types.ParamInfo(
                name=orbax_layout.param_name(t.key), parent_dir=path, ts_context=ctx,
                value_typestr=_VALUE_TYPE, write_shape=t.chunks)
    return tree_metadata.InternalTreeMetadata.build(tree, use_ocdbt=True,
                                                    use_zarr3=False).to_json()


def empty_tree_metadata() -> dict:
    """Orbax's ``_METADATA`` with no leaves (what surrounds its ``tree_metadata``)."""
    from orbax.checkpoint._src.metadata import tree as tree_metadata
    from orbax.checkpoint._src.metadata.pytree_metadata_options import (
        PYTREE_METADATA_OPTIONS,
    )
    ts_utils, _ = _orbax_modules()
    return tree_metadata.InternalTreeMetadata(
        tree_metadata_entries=[], use_ocdbt=True, use_zarr3=False, custom_metadata=None,
        store_array_data_equal_to_fill_value=ts_utils.STORE_ARRAY_DATA_EQUAL_TO_FILL_VALUE,
        pytree_metadata_options=PYTREE_METADATA_OPTIONS).to_json()


def _step_metadata(started_ns: int) -> dict:
    """Orbax's ``_CHECKPOINT_METADATA``: the handler that reads the step."""
    ocp = fmt.orbax()
    from orbax.checkpoint._src.metadata import checkpoint as checkpoint_metadata
    from orbax.checkpoint._src.metadata import step_metadata_serialization

    return step_metadata_serialization.serialize(checkpoint_metadata.StepMetadata(
        item_handlers=ocp.StandardCheckpointHandler.typestr(),
        init_timestamp_nsecs=started_ns, commit_timestamp_nsecs=time.time_ns()))
