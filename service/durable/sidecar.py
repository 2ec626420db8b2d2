"""What one daemon wrote into a step's checkpoint: the record of its sidecar. Pure.

Each daemon writes the regions of the ranks its trainers committed, then
``.bubblesnap/rank_<r>.json`` in the folder written (format.py, persist.py), which
this module turns into :class:`WrittenRank` and back. The sidecars of a step say
whether it is whole (policy.incomplete) and let a reader verify every region it
reads; in a CheckpointManager's item folder, that the rank's write is durable.
"""

import dataclasses
import math

from bubblesnap.service import checks
from bubblesnap.service.durable import orbax_layout
from bubblesnap.service.store import layout as layout_lib

FORMAT = "bubblesnap-durable-2"

Box = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class WrittenTensor:
    """A tensor as one rank wrote it: its regions and the xxh3 of each region's raw
    C-order bytes; ``key`` is its place in the checkpoint's tree, ``chunks`` the zarr
    chunk shape of its array."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    job_wide: bool
    key: tuple[str, ...]
    chunks: tuple[int, ...]
    regions: tuple[Box, ...]
    checksums: tuple[int, ...]

    @property
    def param(self) -> str:
        """Orbax's parameter name of its array."""
        return orbax_layout.param_name(self.key)


@dataclasses.dataclass(frozen=True)
class WrittenRank:
    """One rank's part of a step: world size, replica group (the ranks its copy
    holds, itself included) and its tensors in layout order."""

    job: str
    step: int
    rank: int
    world_size: int
    group: tuple[int, ...]
    tensors: tuple[WrittenTensor, ...]

    def layout(self) -> layout_lib.Layout:
        """The rank's layout as written: a shard per region, in slot order."""
        return layout_lib.Layout(tuple(
            layout_lib.Tensor(t.name, t.dtype, t.shape, tuple(
                layout_lib.Shard(box, math.prod(b - a for a, b in box)
                                 * checks.ITEMSIZE[t.dtype])
                for box in t.regions), t.job_wide)
            for t in self.tensors))

    def slot_checksums(self) -> tuple[int, ...]:
        """Per-region checksums in ``layout().slots()`` order: a slot of the copy is
        one region, so these are the copy's own checksums (which copy this is)."""
        return tuple(c for t in self.tensors for c in t.checksums)

    def to_json(self) -> dict:
        return {"format": FORMAT, "job": self.job, "step": self.step, "rank": self.rank,
                "world_size": self.world_size, "replica_group": list(self.group),
                "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                             "job_wide": t.job_wide, "key": list(t.key),
                             "chunks": list(t.chunks),
                             "regions": [[list(pair) for pair in box] for box in t.regions],
                             "checksums": list(t.checksums)}
                            for t in self.tensors]}

    @classmethod
    def from_json(cls, data: dict) -> "WrittenRank":
        """Raises KeyError, TypeError or ValueError for a record that is not one."""
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, not {FORMAT!r}")
        tensors = tuple(WrittenTensor(
            str(t["name"]), str(t["dtype"]), tuple(int(d) for d in t["shape"]),
            bool(t["job_wide"]), tuple(str(k) for k in t["key"]),
            tuple(int(c) for c in t["chunks"]),
            tuple(tuple((int(a), int(b)) for a, b in box) for box in t["regions"]),
            tuple(int(c) for c in t["checksums"]))
            for t in data["tensors"])
        for t in tensors:
            if len(t.regions) != len(t.checksums) or t.dtype not in checks.ITEMSIZE:
                raise ValueError(f"tensor {t.name!r}: regions, checksums or dtype malformed")
        return cls(str(data["job"]), int(data["step"]), int(data["rank"]),
                   int(data["world_size"]), tuple(int(r) for r in data["replica_group"]),
                   tensors)
