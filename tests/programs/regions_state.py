"""A two-rank job whose ranks copy different regions of its global arrays (test data).

Shared by the durable-tier tests, which register and snapshot it through a
``Session`` (no JAX in the trainer: the regions are chosen by hand), and by
``orbax_restore.py``, which checks what plain Orbax restores against it.

Job-wide: ``params/w`` (float32, 16x8; rank 0 the top rows, rank 1 the
bottom, each as two column blocks, as a (2, 2) mesh of one rank per row
would), ``params/b`` (bfloat16, 12; cut unevenly when ``uneven``, so only
both ranks' regions give the chunk grid) and ``step`` (a replicated int32
scalar, copied once, by rank 0). Each rank also has its own ``opt/mu``
(int32, shapes differ), which the checkpoint holds under ``rank_<r>/``.
"""

import ml_dtypes
import numpy as np

from bubblesnap.protos import daemon_pb2 as pb

JOB = "regions"
WORLD = 2


def job_wide_regions(uneven: bool) -> dict[str, dict[int, list]]:
    bias = [((4, 6),), ((6, 12),)] if uneven else [((4, 8),), ((8, 12),)]
    return {"params/w": {0: [((0, 8), (0, 4)), ((0, 8), (4, 8))],
                         1: [((8, 16), (0, 4)), ((8, 16), (4, 8))]},
            "params/b": {0: [((0, 4),)], 1: bias},
            "step": {0: [()], 1: []}}


def global_state(step: int) -> dict[str, np.ndarray]:
    """The checkpoint's leaves by tree path: what Orbax must restore, bit for bit."""
    return {"params/w": (np.arange(128, dtype=np.float32).reshape(16, 8) * 0.5 + step),
            "params/b": (np.arange(12, dtype=np.float32) / 8 - step).astype(ml_dtypes.bfloat16),
            "step": np.array(step, np.int32),
            "rank_0/opt/mu": np.arange(5, dtype=np.int32) * 3 + step,
            "rank_1/opt/mu": np.arange(6, dtype=np.int32).reshape(3, 2) - step}


#: Target partition specs on a (2, 2) mesh ("a", "b"): other cuts than the regions saved.
TARGET_SPECS = {"params/w": ("b", "a"), "params/b": ("a",), "step": (),
                "rank_0/opt/mu": (), "rank_1/opt/mu": (None, "a")}


def rank_specs(rank: int, step: int, uneven: bool = False):
    """What ``rank`` registers and copies: tensor specs, and the arrays of its slots in
    slot order (the fetch of ``Session.snapshot``)."""
    state = global_state(step)
    specs, arrays = [], []
    for name, by_rank in job_wide_regions(uneven).items():
        specs.append(_spec(name, state[name], by_rank[rank], job_wide=True))
        arrays += [state[name][tuple(slice(a, b) for a, b in box)] for box in by_rank[rank]]
    own = state[f"rank_{rank}/opt/mu"]
    specs.append(_spec("opt/mu", own, [tuple((0, d) for d in own.shape)], job_wide=False))
    arrays.append(own)
    return specs, [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]


def _spec(name: str, array: np.ndarray, boxes, job_wide: bool) -> pb.TensorSpec:
    return pb.TensorSpec(
        name=name, dtype=array.dtype.name, global_shape=array.shape, job_wide=job_wide,
        shards=[pb.ShardSpec(index=[pb.Slice(start=a, stop=b) for a, b in box],
                             nbytes=int(np.prod([b - a for a, b in box], dtype=np.int64))
                             * array.dtype.itemsize, device="host") for box in boxes])
