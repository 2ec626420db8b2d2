"""The record a CheckpointManager's pytree item carries beside its arrays: pure, shared by
both ends.

An item saved through ``bubblesnap.clients.jax.CheckpointManager`` holds more than
arrays: Python and NumPy scalars, strings, ``None`` and empty subtrees, its shardings and
custom metadata, the structure Orbax writes in ``_METADATA``. All of that is one JSON
document, the *record*, travelling inside the item's snapshot as the uint8 tensor
:data:`TENSOR` of a fixed ``capacity`` that the primary process copies: it has the
snapshot's checksums, is replicated, adopted after a daemon restart and restored with
the arrays, never sent on a side channel that could disagree with them.

A layout holding :data:`TENSOR` is a manager's item: its other tensors are named
``<item>/<path>``, and a daemon that persists the item writes from the record what
Orbax's PyTree handler writes beside the arrays (``_METADATA``, the scalars, strings
and shardings: service/durable/item_files.py); a restore from memory rebuilds the tree
from it.

The document: ``{"format", "step", "time", "items": {<item>: <entry>}}`` with one
pytree entry. An entry lists its leaves in flatten order, each ``[keys, key_types,
value_type, info]``: its key names, their Orbax key types (one digit each: 1 a
sequence index, 2 a dict key or attribute), Orbax's value type (``jax.Array``,
``np.ndarray``, ``scalar``, ``string``, or an empty value's
``None``/``Dict``/``List``/``Tuple``), and for an array ``[shape, dtype, sharding]``
(an index into the entry's ``shardings``, -1: none; a JAX PRNG key adds its
implementation's name, and its tensor is its key data, as Orbax stores keys), for a
scalar or string its Python type name, whose value is in the entry's ``values`` under
the leaf's index. An array leaf is the tensor :func:`tensor_name` names.
:func:`leaves` reads them back.

The bytes: 8 little-endian bytes giving the document's length, the UTF-8 JSON, zeros
up to the capacity. :func:`decode` refuses anything else with ValueError (the daemon
decodes what a trainer wrote: never trusted).
"""

import dataclasses
import json
import re
import struct

#: bubblesnap's own folder where it keeps something beside Orbax's files: in a folder a
#: daemon persisted an item into, until the step is finalized; in a manager's directory,
#: its saves in flight and the other items of steps held in memory only (when asked for).
STATE_DIR = ".bubblesnap"


def persisted_file(rank: int) -> str:
    """In a folder a daemon persisted a rank's copy into (the Persist call), what says the
    write is durable (the rank's sidecar), relative to the folder. The trainer waits for
    it or :func:`failed_file`; whoever finalizes the step removes these answers first
    (save_in_flight.py): the step keeps what Orbax writes."""
    return f"{STATE_DIR}/rank_{rank}.json"


def failed_file(rank: int) -> str:
    """What says why a daemon's Persist of ``rank`` into a folder failed (its text)."""
    return f"{STATE_DIR}/rank_{rank}.failed"


def writing_file(rank: int) -> str:
    """What says a daemon began writing ``rank``'s copy into a folder (the Persist call),
    before any of it is there."""
    return f"{STATE_DIR}/rank_{rank}.writing"


#: Names of a step's own files, which no item may take.
RESERVED_ITEMS = ("_CHECKPOINT_METADATA", "commit_success.txt", "_METADATA")

#: The tensor an item's record travels in (the primary process copies it; every rank
#: declares it, job-wide, so any process count restores it).
TENSOR = ".bubblesnap/record"
#: The record's document format.
FORMAT = "bubblesnap-record-2"
#: Default capacity of the record tensor: room for the leaves of a pytree of ~10,000
#: arrays; an item that does not fit is saved by Orbax's own handler instead.
DEFAULT_CAPACITY = 1 << 20
#: Orbax's value types of leaves held as tensors, of Python values, and of empty values.
ARRAY_TYPES = ("jax.Array", "np.ndarray")
VALUE_TYPES = {"scalar": ("int", "float", "bool"), "string": ("str",)}
EMPTY_TYPES = ("None", "Dict", "List", "Tuple", "NamedTuple")
#: What JSON gives back for a value of each Python type (a float may read back as an int).
_JSON_TYPES = {"int": "int", "float": "float", "bool": "bool", "str": "str"}

_LENGTH = struct.Struct("<Q")
#: Item names become folder names: Orbax's CheckpointManager uses them as is.
_ITEM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


def encode(record: dict, capacity: int, texts: dict | None = None) -> bytes:
    """The record's bytes, ``capacity`` long; ValueError when it does not fit.
    ``texts``: item name -> its entry already as JSON text (a pytree's leaves are the
    same save after save: their text is made once), used instead of ``record``'s."""
    data = encode_head(record, capacity, texts)
    return data + bytes(capacity - len(data))


def encode_head(record: dict, capacity: int, texts: dict | None = None) -> bytes:
    """The record's bytes without the zeros after them (:func:`encode`'s first part: a
    caller that keeps a zeroed buffer writes only these)."""
    texts = texts or {}
    items = ",".join(f"{json.dumps(name)}:" + (texts[name] if name in texts else _json(entry))
                     for name, entry in record["items"].items())
    rest = _json({k: v for k, v in record.items() if k != "items"})
    data = f'{rest[:-1]}{"," if len(rest) > 2 else ""}"items":{{{items}}}}}'.encode()
    if _LENGTH.size + len(data) > capacity:
        raise ValueError(f"the step record needs {_LENGTH.size + len(data)} bytes; the "
                         f"record tensor holds {capacity}")
    return _LENGTH.pack(len(data)) + data


def _json(value) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=True)


def decode(data) -> dict:
    """The record in ``data`` (bytes-like, as :func:`encode` wrote it), checked:
    ValueError saying what is wrong when it is not one."""
    view = memoryview(data).cast("B")
    if len(view) < _LENGTH.size:
        raise ValueError(f"a step record has at least {_LENGTH.size} bytes, not {len(view)}")
    (length,) = _LENGTH.unpack(view[:_LENGTH.size])
    if length > len(view) - _LENGTH.size:
        raise ValueError(f"the step record says {length} bytes; {len(view) - _LENGTH.size} "
                         "follow")
    try:
        record = json.loads(bytes(view[_LENGTH.size:_LENGTH.size + length]))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise ValueError(f"the step record is not JSON: {str(err)[:200]}") from None
    check(record)
    return record


def check(record) -> None:
    """ValueError unless ``record`` is a record of :data:`FORMAT` of one pytree item whose
    name is safe to use as a folder name."""
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} item record")
    items = record.get("items")
    if not isinstance(items, dict) or len(items) != 1:
        raise ValueError("an item record names one item")
    for name, item in items.items():
        check_item_name(name)
        if not isinstance(item, dict) or item.get("kind") != "pytree" or \
                not isinstance(item.get("handler"), str):
            raise ValueError(f"item {name!r} of the record is malformed")
        leaves(item, name)  # checks each leaf
    if not isinstance(record.get("time", 0), (int, float)) or isinstance(record.get("time"),
                                                                         bool):
        raise ValueError("the item record's time is not a number")


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One leaf of a pytree item, as its record entry lists it (see the module's text):
    ``value`` is the scalar or string (None for others)."""

    index: int
    keys: tuple[str, ...]
    key_types: str
    value_type: str
    shape: tuple[int, ...] = ()
    dtype: str = ""
    sharding: str | None = None
    python_type: str = ""
    value: object = None
    key_impl: str = ""

    @property
    def path_key(self) -> str:
        """Orbax's key of the leaf in ``_METADATA`` (its key names as a tuple, in text)."""
        return str(self.keys)

    @property
    def param(self) -> str:
        """Orbax's parameter name of the leaf (its key names joined by ".")."""
        return ".".join(self.keys)

    @property
    def is_array(self) -> bool:
        return self.value_type in ARRAY_TYPES

    def metadata(self, write_shape=None) -> dict:
        """The leaf's entry of Orbax's ``_METADATA`` (``write_shape``: a jax.Array's)."""
        value = {"value_type": self.value_type,
                 "skip_deserialize": self.value_type in EMPTY_TYPES}
        if self.value_type == "jax.Array":
            value["write_shape"] = list(write_shape or ())
        return {"key_metadata": [{"key": k, "key_type": int(t)}
                                 for k, t in zip(self.keys, self.key_types, strict=True)],
                "value_metadata": value}


def leaves(entry: dict, item: str = "") -> list[Leaf]:
    """The leaves of a pytree item's entry; ValueError naming what is malformed."""
    listed, shardings = entry.get("leaves"), entry.get("shardings", [])
    values = entry.get("values", {})
    if not isinstance(listed, list) or not isinstance(shardings, list) or \
            not isinstance(values, dict):
        raise ValueError(f"pytree item {item!r} of the step record has no leaves")
    found = []
    for index, raw in enumerate(listed):
        try:
            keys, key_types, value_type, info = raw
            keys = tuple(keys)
            if not all(isinstance(k, str) for k in keys) or len(key_types) != len(keys) or \
                    set(key_types) - {"1", "2"}:
                raise ValueError("keys")
            if value_type in ARRAY_TYPES:
                shape, dtype, sharding, *key_impl = info
                if not all(isinstance(d, int) and d >= 0 for d in shape) or \
                        not isinstance(dtype, str) or not -1 <= sharding < len(shardings) or \
                        len(key_impl) > 1 or not all(isinstance(k, str) for k in key_impl):
                    raise ValueError("array")
                found.append(Leaf(index, keys, key_types, value_type, tuple(shape), dtype,
                                  shardings[sharding] if sharding >= 0 else None,
                                  key_impl="".join(key_impl)))
            elif value_type in VALUE_TYPES:
                if info not in VALUE_TYPES[value_type] or str(index) not in values or \
                        type(values[str(index)]).__name__ != _JSON_TYPES[info]:
                    raise ValueError("value")
                found.append(Leaf(index, keys, key_types, value_type, python_type=info,
                                  value=values[str(index)]))
            elif value_type in EMPTY_TYPES and info is None:
                found.append(Leaf(index, keys, key_types, value_type))
            else:
                raise ValueError("value type")
        except (TypeError, ValueError):
            raise ValueError(f"leaf {index} of pytree item {item!r} of the step record is "
                             "malformed") from None
    return found


def tensor_name(item: str, keys) -> str:
    """The tensor of the array leaf at ``keys`` of ``item``: the names joined by "/", a
    "/" or "%" inside a name escaped ("%2F", "%25") so the daemon can split it back."""
    return "/".join([item, *(k.replace("%", "%25").replace("/", "%2F") for k in keys)])


def check_item_name(name) -> None:
    """ValueError unless ``name`` may name an item (a folder of the step)."""
    if not isinstance(name, str) or not _ITEM_NAME.fullmatch(name) or name in RESERVED_ITEMS:
        raise ValueError(f"item name {str(name)[:80]!r} is not allowed: use 1-128 characters "
                         "from A-Z a-z 0-9 . _ - not starting with '.' or '-', and none of "
                         f"{', '.join(RESERVED_ITEMS)}")
