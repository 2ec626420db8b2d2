"""One pytree item of a CheckpointManager step: arrays as tensors, every other leaf in the
step record, and back into the types Orbax gives back for the same target.

Saving flattens the pytree as Orbax does (``None`` and empty subtrees are
leaves; custom nodes such as Flax's ``TrainState`` by their key paths): a
``jax.Array`` or numpy array (NumPy scalars as 0-d arrays) becomes a tensor
``<item>/<key>/<key>...`` of the snapshot; a Python scalar or string, a
``None`` or an empty subtree is kept in the item's entry of the step record
(``bubblesnap/shared/checkpoint_record.py``), which also holds Orbax's
``_METADATA`` entries of the whole tree, so the durable tier writes what
Orbax writes and a restore with no target rebuilds the tree Orbax would.

Restoring into a target follows Orbax's handlers: a ``jax.Array`` or
``jax.ShapeDtypeStruct`` leaf gets a ``jax.Array`` in its sharding (or the
sharding ``restore_args`` give), a numpy array a numpy array, a Python or
NumPy scalar a Python scalar, a string a string, ``None`` and empty
subtrees themselves.
"""

import dataclasses
import json

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.metadata import empty_values
from orbax.checkpoint._src.metadata import sharding as sharding_metadata
from orbax.checkpoint._src.metadata import tree as tree_metadata
from orbax.checkpoint._src.metadata.pytree_metadata_options import PYTREE_METADATA_OPTIONS
from orbax.checkpoint._src.tree import utils as tree_utils

from bubblesnap.clients.results import RestoreError
from bubblesnap.shared import checkpoint_record

#: Orbax's value types (``_METADATA``'s ``value_type``) of the leaves kept as tensors.
JAX_ARRAY, NP_ARRAY, SCALAR, STRING = "jax.Array", "np.ndarray", "scalar", "string"
ARRAY_TYPES = checkpoint_record.ARRAY_TYPES
_STANDARD = ocp.StandardCheckpointHandler.typestr()


def _key_names(keypath) -> tuple[str, ...]:
    return tuple(str(tree_utils.get_key_name(k)) for k in keypath)


def _path_key(keypath) -> str:
    """Orbax's key of a leaf in ``_METADATA`` (the tuple of its key names, as text)."""
    return str(_key_names(keypath))


def _key_types(keypath) -> str:
    return "".join(str(tree_metadata.KeyMetadataEntry.build((k,)).nested_key_metadata_entries[0]
                       .key_type.value) for k in keypath)


def _flatten(tree):
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=tree_utils.is_empty_or_leaf)


@dataclasses.dataclass(frozen=True)
class SavedItem:
    """What one pytree item puts in a snapshot: ``names[i]`` is the tensor of
    ``arrays[i]`` (a jax.Array or numpy array); ``entry`` its part of the record and
    ``text`` that part as JSON."""

    names: list
    arrays: list
    entry: dict
    text: str


class ItemSaver:
    """Splits pytree items into tensors and record entries. A tree's leaves (keys,
    types, shapes, shardings) are the same save after save: their part of the entry
    and its JSON text are made once per structure and kept."""

    def __init__(self):
        self._known: dict = {}  # structure -> (names, static entry, text before "values")

    def save(self, item: str, tree, handler: str, custom_metadata=None) -> SavedItem:
        """TypeError for a leaf Orbax cannot save. ``custom_metadata``: the item's own
        (Orbax keeps it in the item's ``_METADATA``)."""
        flat, treedef = _flatten(tree)
        numpy_scalars = handler != _STANDARD  # Orbax's PyTree handler takes them as scalars
        kinds = [_classify(keypath, leaf, numpy_scalars) for keypath, leaf in flat]
        keys = {i: str(jax.random.key_impl(leaf)) for i, (_, leaf) in enumerate(flat)
                if _is_key(leaf)}
        arrays = [stored for value_type, stored in kinds if value_type in ARRAY_TYPES]
        structure = (item, handler, treedef, tuple(
            (t, stored.shape, str(stored.dtype), getattr(stored, "sharding", None), keys.get(i))
            if t in ARRAY_TYPES else (t, type(stored).__name__)
            for i, (t, stored) in enumerate(kinds)))
        if structure not in self._known:
            self._known[structure] = _structure(item, handler, flat, kinds, keys)
            if len(self._known) > 64:  # a loop whose tree keeps changing
                self._known.pop(next(iter(self._known)))
        names, entry, text = self._known[structure]
        values = {str(i): stored for i, (t, stored) in enumerate(kinds)
                  if t in checkpoint_record.VALUE_TYPES}
        values_text = json.dumps(values, separators=(",", ":"), allow_nan=True)
        dynamic = {"values": values}
        if custom_metadata is not None:
            dynamic["custom_metadata"] = custom_metadata
            values_text += ',"custom_metadata":' + json.dumps(custom_metadata,
                                                              separators=(",", ":"))
        return SavedItem(names, arrays, {**entry, **dynamic},
                         f'{text},"values":{values_text}}}')


def _structure(item: str, handler: str, flat, kinds, keys: dict):
    names, leaves, shardings = [], [], {}
    for at, ((keypath, _), (value_type, stored)) in enumerate(zip(flat, kinds, strict=True)):
        key_names = list(_key_names(keypath))
        if value_type in ARRAY_TYPES:
            names.append(checkpoint_record.tensor_name(item, key_names))
            sharding = _serialized_sharding(stored)
            index = -1 if sharding is None else shardings.setdefault(sharding, len(shardings))
            info = [list(stored.shape), np.dtype(stored.dtype).name, index]
            if at in keys:  # a PRNG key: its key data is the tensor
                info.append(keys[at])
        elif value_type in checkpoint_record.VALUE_TYPES:
            info = type(stored).__name__
        else:
            info = None
        leaves.append([key_names, _key_types(keypath), value_type, info])
    entry = {"kind": "pytree", "handler": handler, "leaves": leaves,
             "shardings": list(shardings)}
    text = json.dumps(entry, separators=(",", ":"))[:-1]
    return names, entry, text


def _is_key(leaf) -> bool:
    return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype,
                                                                 jax.dtypes.prng_key)


def _classify(keypath, leaf, numpy_scalars: bool):
    """(Orbax's value type, what is kept: an array, a Python value or None).
    ``numpy_scalars``: a NumPy scalar is a scalar (Orbax's PyTree handler), else a 0-d
    numpy array (its Standard handler)."""
    if _is_key(leaf):
        return JAX_ARRAY, jax.random.key_data(leaf)  # as Orbax stores a key
    if isinstance(leaf, jax.Array):
        return JAX_ARRAY, leaf
    if numpy_scalars and isinstance(leaf, (np.number, np.bool_)):
        leaf = leaf.item()
    elif isinstance(leaf, (np.ndarray, np.number, np.bool_)):
        return NP_ARRAY, np.asarray(leaf)
    if isinstance(leaf, (bool, int, float)):  # subclasses (an IntEnum) as their base type
        leaf = bool(leaf) if isinstance(leaf, bool) else \
            int(leaf) if isinstance(leaf, int) else float(leaf)
        if isinstance(leaf, int) and not isinstance(leaf, bool) and not -2**63 <= leaf < 2**63:
            raise TypeError(f"leaf {_path_key(keypath)}: the int {leaf} does not fit int64, "
                            "as Orbax saves Python ints")
        return SCALAR, leaf
    if isinstance(leaf, str):  # numpy's str_ too
        return STRING, str(leaf)
    if leaf is None or empty_values.is_empty_container(leaf):
        if tree_utils.isinstance_of_namedtuple(leaf):  # optax's EmptyState: Orbax says None
            return empty_values.override_empty_value_typestr(
                empty_values.RESTORE_TYPE_NAMED_TUPLE, PYTREE_METADATA_OPTIONS), None
        return empty_values.get_empty_value_typestr(leaf, PYTREE_METADATA_OPTIONS), None
    raise TypeError(f"leaf {_path_key(keypath)} is a {type(leaf).__name__}, which Orbax's "
                    "PyTree handlers do not save: keep arrays, Python or NumPy scalars, "
                    "strings and None in the state (or save it with an item of its own)")


def _serialized_sharding(array) -> str | None:
    if not isinstance(array, jax.Array):
        return None
    found = sharding_metadata.from_jax_sharding(array.sharding)
    return found.to_serialized_string() if found is not None else None


@dataclasses.dataclass(frozen=True)
class Wanted:
    """A tensor a restore asks for: into ``target`` (a jax.ShapeDtypeStruct with a
    sharding), or as a numpy array when ``host``."""

    name: str
    target: jax.ShapeDtypeStruct
    host: bool


class RestorePlan:
    """How one item of a step comes back: the tensors to ask the daemon for
    (:attr:`wanted`) and :meth:`build`, which makes the restored tree of them.

    ``target``: the tree to restore into (its structure and leaf types), or None
    for the tree as saved (numpy and jax arrays, scalars, strings; dicts and lists
    as Orbax rebuilds them). ``restore_args``: a matching tree of Orbax's
    ``RestoreArgs`` / ``ArrayRestoreArgs`` (``construct_restore_args``), whose
    ``sharding``, ``dtype`` and ``restore_type`` win over the target's.
    ``saved_types``: the leaves come back as the types they were saved as, into
    the target's structure and shardings (Orbax's PyTree handler without
    ``restore_args``; its Standard handler restores the target's types).
    ``fallback_sharding``: for an array leaf whose target has none (StandardRestore's).
    A target may hold fewer leaves than the item (Orbax's partial restore).
    """

    def __init__(self, item: str, entry: dict, target=None, restore_args=None,
                 saved_types: bool = False, fallback_sharding=None):
        self.item, self._fallback_sharding = item, fallback_sharding
        self._saved = {leaf.path_key: leaf for leaf in checkpoint_record.leaves(entry, item)}
        if target is None:
            target = tree_utils.from_flattened_with_keypath(
                [(keypath_of(leaf), _saved_placeholder(leaf)) for leaf in self._saved.values()])
        flat, self._treedef = _flatten(target)
        args = _flatten_args(restore_args, self._treedef, len(flat))
        self._leaves = []  # (saved leaf, target leaf, restore args, Wanted or None)
        self.wanted: list[Wanted] = []
        for (keypath, leaf), arg in zip(flat, args, strict=True):
            saved = self._saved.get(_path_key(keypath))
            if saved is None:
                raise RestoreError(f"item {item!r} has no leaf {_path_key(keypath)} to restore "
                                   "into the target: restore into the structure it was saved "
                                   "with")
            if saved_types and arg is None and (
                    saved.is_array or saved.value_type in checkpoint_record.VALUE_TYPES):
                leaf = _as_saved(saved, leaf)  # an empty node stays the target's
            wanted = self._want(saved, leaf, arg) if saved.is_array else None
            if wanted is not None:
                self.wanted.append(wanted)
            self._leaves.append((saved, leaf, arg, wanted))

    def _want(self, saved, leaf, arg) -> Wanted:
        shape, dtype = saved.shape, np.dtype(numpy_dtype(saved.dtype))
        logical = shape[:len(shape) - _key_axes(saved)]
        if hasattr(leaf, "shape") and tuple(leaf.shape) not in (shape, logical):
            raise RestoreError(f"item {self.item!r}: leaf {saved.path_key} was saved with "
                               f"shape {shape}; the target has {tuple(leaf.shape)}")
        restore_type = getattr(arg, "restore_type", None)
        host = isinstance(leaf, (np.ndarray, np.number, np.bool_, bool, int, float,
                                 _SavedNumpy)) or \
            (restore_type is not None and restore_type is not jax.Array)
        sharding = getattr(arg, "sharding", None) or _mesh_sharding(arg) or \
            getattr(leaf, "sharding", None) or self._fallback_sharding
        if isinstance(sharding, sharding_metadata.ShardingMetadata):
            sharding = sharding.to_jax_sharding()
        name = checkpoint_record.tensor_name(self.item, saved.keys)
        return Wanted(name, jax.ShapeDtypeStruct(shape, dtype, sharding=sharding), host)

    def build(self, restored: dict):
        """The item's tree, from ``restored`` (tensor name -> jax.Array or numpy array)."""
        out = []
        for saved, leaf, arg, wanted in self._leaves:
            value = restored[wanted.name] if wanted is not None else \
                saved.value if saved.value_type in checkpoint_record.VALUE_TYPES else leaf
            if saved.key_impl and isinstance(value, jax.Array):
                value = jax.random.wrap_key_data(value, impl=saved.key_impl)
            out.append(_as_target_type(value, leaf, arg))
        return jax.tree_util.tree_unflatten(self._treedef, out)


def _mesh_sharding(arg):
    """The sharding an ``ArrayRestoreArgs`` names by ``mesh`` and ``mesh_axes`` (Orbax's
    older form), or None."""
    mesh, axes = getattr(arg, "mesh", None), getattr(arg, "mesh_axes", None)
    if mesh is None or axes is None:
        return None
    if not isinstance(axes, jax.sharding.PartitionSpec):
        axes = jax.sharding.PartitionSpec(*axes)
    return jax.sharding.NamedSharding(mesh, axes)


def _key_axes(saved) -> int:
    """The trailing axes a PRNG key's data has beyond the key's own shape."""
    if not saved.key_impl:
        return 0
    return len(jax.eval_shape(jax.random.key_data,
                              jax.ShapeDtypeStruct((), jax.random.key(0, impl=saved.key_impl)
                                                   .dtype)).shape)


def keypath_of(leaf) -> tuple:
    """The jax key path of a record leaf (checkpoint_record.Leaf)."""
    return tuple(jax.tree_util.SequenceKey(int(k)) if t == "1" else jax.tree_util.DictKey(k)
                 for k, t in zip(leaf.keys, leaf.key_types, strict=True))


@dataclasses.dataclass(frozen=True)
class _SavedNumpy:
    """The target leaf of a numpy array restored with no target (a pytree leaf)."""

    shape: tuple
    dtype: np.dtype


def _saved_placeholder(saved):
    """A target leaf that restores ``saved`` as Orbax restores it with no target: an
    array as saved (a jax.Array in its saved sharding when this process has those
    devices, else on the first local device), the rest as it was."""
    if saved.value_type == NP_ARRAY:
        return _SavedNumpy(saved.shape, numpy_dtype(saved.dtype))
    if saved.value_type == JAX_ARRAY:
        return jax.ShapeDtypeStruct(saved.shape, numpy_dtype(saved.dtype),
                                    sharding=_saved_sharding(saved.sharding))
    if saved.value_type in checkpoint_record.VALUE_TYPES:
        return {"bool": False, "int": 0, "float": 0.0}.get(saved.python_type, "")
    return empty_values.get_empty_value_from_typestr(saved.value_type, PYTREE_METADATA_OPTIONS)


def _as_saved(saved, leaf):
    """The target leaf for ``saved``'s own type, in ``leaf``'s sharding."""
    placeholder = _saved_placeholder(saved)
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None and isinstance(placeholder, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(placeholder.shape, placeholder.dtype, sharding=sharding)
    return placeholder


def _saved_sharding(serialized: str | None):
    if serialized:
        try:
            return sharding_metadata.from_serialized_string(serialized).to_jax_sharding()
        except Exception:  # the devices it names are not this process's
            pass
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _flatten_args(restore_args, treedef, count: int) -> list:
    if restore_args is None:
        return [None] * count
    try:
        return treedef.flatten_up_to(restore_args)
    except (ValueError, TypeError) as err:
        raise RestoreError(f"restore_args do not match the target's structure: {err}") from None


def _as_target_type(value, leaf, arg):
    """``value`` (restored array, or record value) as the type the target leaf asks."""
    restore_type = getattr(arg, "restore_type", None)
    dtype = getattr(arg, "dtype", None)
    if isinstance(value, (jax.Array, np.ndarray)) and dtype is not None and \
            not _is_key(value) and np.dtype(value.dtype) != np.dtype(dtype):
        value = value.astype(dtype)
    if leaf is None or empty_values.is_empty_container(leaf):
        return leaf
    # a scalar type (an IntEnum too) is applied to the value, as Orbax's scalar handler does
    scalar_type = restore_type if isinstance(restore_type, type) and issubclass(
        restore_type, (bool, int, float)) else None
    if scalar_type is not None or (
            restore_type is None and isinstance(leaf, (bool, int, float, np.number, np.bool_))):
        kind = scalar_type or (type(leaf) if isinstance(leaf, (bool, int, float)) else None)
        scalar = value.item() if isinstance(value, (jax.Array, np.ndarray)) else value
        return kind(scalar) if kind is not None else scalar
    if isinstance(leaf, str):
        return str(value)
    if restore_type is np.ndarray or (restore_type is None and
                                      isinstance(leaf, (np.ndarray, _SavedNumpy))):
        return np.asarray(value, dtype=dtype)
    if isinstance(value, (bool, int, float)):  # a saved scalar into an array target
        sharding = getattr(arg, "sharding", None) or getattr(leaf, "sharding", None)
        array = np.asarray(value, dtype=getattr(leaf, "dtype", None))
        return jax.device_put(array, sharding) if sharding is not None else jax.numpy.asarray(
            array)
    return value


def numpy_dtype(name: str):
    """The numpy dtype a layout's dtype name stands for (bfloat16 and float8 too)."""
    import ml_dtypes  # bfloat16 and float8, which numpy lacks (a dependency of JAX)

    return np.dtype(getattr(ml_dtypes, name, name))
