"""The record a CheckpointManager step carries beside its arrays: pure, shared by both ends.

A step saved through ``bubblesnap.clients.jax.CheckpointManager`` holds more
than arrays: Python and NumPy scalars, strings, ``None`` and empty subtrees
of its pytrees, JSON items, ``custom_metadata``, metrics, and how Orbax lays
the step out (step folder name, items and their handlers, each pytree's
``_METADATA`` entries). All of that is one JSON document, the *record*,
travelling inside the snapshot as the uint8 tensor :data:`TENSOR` of a fixed
``capacity`` that rank 0 copies: it has the step's checksums, is replicated,
adopted after a daemon restart and restored with the arrays, never sent on
a side channel that could disagree with them.

A layout holding :data:`TENSOR` is a manager's: its other tensors are named
``<item>/<path>``, and the daemon's durable writer turns the record into the
files Orbax's CheckpointManager writes for the same step (``<step>/<item>/``
checkpoints, JSON items, ``_CHECKPOINT_METADATA``), so plain Orbax reads it.

A pytree item's entry lists its leaves in flatten order, each
``[keys, key_types, value_type, info]``: its key names, their Orbax key
types (one digit each: 1 a sequence index, 2 a dict key or attribute),
Orbax's value type (``jax.Array``, ``np.ndarray``, ``scalar``, ``string``,
or an empty value's ``None``/``Dict``/``List``/``Tuple``), and for an array
``[shape, dtype, sharding]`` (an index into the entry's ``shardings``, -1:
none; a JAX PRNG key adds its implementation's name, and its tensor is its
key data, as Orbax stores keys), for a scalar or string its Python type name, whose value is in the
entry's ``values`` under the leaf's index. An array leaf is the tensor
:func:`tensor_name` names. :func:`leaves` reads them back.

The bytes: 8 little-endian bytes giving the document's length, the UTF-8
JSON, zeros up to the capacity. :func:`decode` refuses anything else with
ValueError (the daemon decodes what a trainer wrote: never trusted).
"""

import dataclasses
import json
import re
import struct

#: The folder names a manager and the daemons share in a job's folder: bubblesnap's own
#: state (in a step: sidecars, the record, the completion marker), the steps being
#: written, the items a manager
#: saved with Orbax's handlers before the daemon persisted their step, and the steps a
#: manager deleted (a daemon must not publish them after).
STATE_DIR = ".bubblesnap"
MARKER_FILE = "complete.json"
RECORD_FILE = "record.json"
PARTIAL_DIR = f"{STATE_DIR}/partial"
ITEMS_DIR = f"{STATE_DIR}/items"
DELETED_DIR = f"{STATE_DIR}/deleted"
#: Names of a step's own files, which no item may take.
RESERVED_ITEMS = ("_CHECKPOINT_METADATA", "commit_success.txt", "_METADATA")

#: The tensor a manager's step record travels in (rank 0 copies it; every rank
#: declares it, job-wide, so any process count restores it).
TENSOR = ".bubblesnap/record"
#: The record's document format; a daemon writes the files of the formats it knows.
FORMAT = "bubblesnap-record-1"
#: Default capacity of the record tensor: room for JSON items, metadata and the
#: leaves of pytrees of ~10,000 arrays; an item that does not fit is saved by
#: Orbax's own handler instead.
DEFAULT_CAPACITY = 1 << 20
#: Orbax's value types of leaves held as tensors, of Python values, and of empty values.
ARRAY_TYPES = ("jax.Array", "np.ndarray")
VALUE_TYPES = {"scalar": ("int", "float", "bool"), "string": ("str",)}
EMPTY_TYPES = ("None", "Dict", "List", "Tuple", "NamedTuple")
#: What JSON gives back for a value of each Python type (a float may read back as an int).
_JSON_TYPES = {"int": "int", "float": "float", "bool": "bool", "str": "str"}
#: Item kinds: a pytree held in memory (arrays as tensors, other leaves in the
#: record), a JSON value (in the record), an item Orbax's own handler wrote to the
#: step's folder in the durable tier (nothing of it in memory).
KINDS = ("pytree", "json", "orbax")

_LENGTH = struct.Struct("<Q")
#: Item names become folder names of the step: Orbax's CheckpointManager uses them as is.
_ITEM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
#: A step prefix becomes part of a folder name (``<prefix>_<step>``).
_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_MAX_FIXED_LENGTH = 32


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
    """ValueError unless ``record`` is a record of :data:`FORMAT` whose names are safe
    to use as folder names."""
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} step record")
    items = record.get("items")
    if not isinstance(items, dict):
        raise ValueError("the step record has no items")
    for name, item in items.items():
        check_item_name(name)
        if not isinstance(item, dict) or item.get("kind") not in KINDS or \
                not isinstance(item.get("handler"), str):
            raise ValueError(f"item {name!r} of the step record is malformed")
        if item["kind"] == "pytree":
            leaves(item, name)  # checks each leaf
    naming = record.get("naming", {})
    if not isinstance(naming, dict):
        raise ValueError("the step record's naming is malformed")
    step_dir_name(0, naming.get("prefix"), naming.get("fixed_length"))  # checks both
    for key in ("custom_metadata", "metrics"):
        if record.get(key) is not None and not isinstance(record[key], dict):
            raise ValueError(f"the step record's {key} is not an object")
    if not isinstance(record.get("time", 0), (int, float)) or isinstance(record.get("time"),
                                                                         bool):
        raise ValueError("the step record's time is not a number")


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


def step_dir_name(step: int, prefix: str | None = None, fixed_length: int | None = None) -> str:
    """The folder of ``step`` as Orbax's CheckpointManager names it: ``<prefix>_<step>``
    with ``prefix``, the bare number without; ``fixed_length`` pads with zeros."""
    if prefix is not None and (not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix)):
        raise ValueError(f"step prefix {str(prefix)[:80]!r} is not allowed: use 1-64 "
                         "characters from A-Z a-z 0-9 . _ - starting with a letter or digit")
    if fixed_length is not None and (not isinstance(fixed_length, int) or isinstance(
            fixed_length, bool) or not 0 < fixed_length <= _MAX_FIXED_LENGTH):
        raise ValueError(f"step_format_fixed_length {fixed_length!r} must be None or an int "
                         f"from 1 to {_MAX_FIXED_LENGTH}")
    number = f"{step:0{fixed_length}d}" if fixed_length else str(step)
    return f"{prefix}_{number}" if prefix else number


def step_of_dir_name(name: str, prefix: str | None = None,
                     fixed_length: int | None = None) -> int | None:
    """The step a folder named ``name`` holds under that naming, None if it is not one."""
    digits = name
    if prefix:
        if not name.startswith(prefix + "_"):
            return None
        digits = name[len(prefix) + 1:]
    if not digits.isdigit() or not digits.isascii() or (fixed_length and len(digits) <
                                                        fixed_length):
        return None
    step = int(digits)
    return step if step_dir_name(step, prefix, fixed_length) == name else None
