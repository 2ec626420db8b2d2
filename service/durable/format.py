"""The durable tier's files: one Orbax checkpoint per written rank and step, and its sidecar.

``<directory>/<job>/step_<step>/rank_<rank>/`` is an Orbax checkpoint of the
rank's state as a nested dict of numpy arrays (tensor names split at "/"),
so ``orbax.checkpoint.StandardCheckpointer().restore(path)`` loads it with
no daemon, into any sharding. Beside it, ``rank_<rank>.json`` lists each
tensor's dtype, shape and xxh3 checksum; it is written last, so a rank
directory without it is an unfinished write and is ignored. The members of a
data-parallel replica group are written once, as their copier (the lowest
rank); its ``.json`` names the group.

Orbax and JAX are imported on first use: a daemon without ``--durable-dir``
does not need them.
"""

import json
import os
import re

import numpy as np

from bubblesnap.service.errors import DataLoss, FailedPrecondition, NotFound

FORMAT = "bubblesnap-durable-1"
_STEP_DIR = re.compile(r"step_(\d+)")
_RANK_META = re.compile(r"rank_(\d+)\.json")


def rank_path(directory: str, job: str, step: int, rank: int) -> str:
    return os.path.join(directory, job, f"step_{step}", f"rank_{rank}")


def step_numbers(directory: str, job: str) -> list[int]:
    """Steps with a directory under the job (finished or not)."""
    return [int(m[1]) for m in map(_STEP_DIR.fullmatch, _listdir(os.path.join(directory, job)))
            if m]


def written_ranks(directory: str, job: str, step: int) -> list[int]:
    """Ranks of a step whose sidecar is written (finished writes)."""
    step_dir = os.path.join(directory, job, f"step_{step}")
    return [int(m[1]) for m in map(_RANK_META.fullmatch, _listdir(step_dir)) if m]


def read_meta(path: str) -> dict:
    """The sidecar of the rank checkpoint at ``path``; NotFound or DataLoss."""
    try:
        with open(path + ".json") as f:
            return json.load(f)
    except FileNotFoundError as err:
        raise NotFound(f"the durable tier has no {path}") from err
    except (OSError, ValueError) as err:
        raise DataLoss(f"{path}.json is unreadable: {err}") from err


def write_meta(path: str, meta: dict) -> None:
    """Writes the sidecar atomically (fsynced, then renamed): it marks the write finished."""
    tmp = path + ".json.tmp"
    with open(tmp, "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path + ".json")


def numpy_dtype(name: str) -> np.dtype:
    import ml_dtypes  # bfloat16 and float8, which numpy lacks (a dependency of JAX)

    return np.dtype(getattr(ml_dtypes, name, name))


def nest(arrays: dict[str, np.ndarray]) -> dict:
    """Tensor names split at "/" as nested dicts (what a Flax/optax state looks like)."""
    tree: dict = {}
    for name, array in arrays.items():
        node = tree
        *parents, leaf = name.split("/")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise FailedPrecondition(f"tensor {name!r} nests under another tensor's name; "
                                         "the durable tier cannot write this state")
        if leaf in node or not leaf:
            raise FailedPrecondition(f"tensor name {name!r} cannot be a path of a nested "
                                     "checkpoint (empty part or used twice)")
        node[leaf] = array
    return tree


def lookup(tree, name: str):
    node = tree
    for part in name.split("/"):
        node = node[part]
    return node


def orbax():
    """orbax.checkpoint, imported on first use; ImportError saying what to install."""
    try:
        import orbax.checkpoint as ocp
    except ImportError as err:
        raise ImportError("the durable tier writes through Orbax: pip install "
                          "'bubblesnap[jax]' (orbax-checkpoint) on this host") from err
    return ocp


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []
