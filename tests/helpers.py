"""Small builders shared by the tests."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.service.checks import ITEMSIZE

ROOT = Path(__file__).resolve().parent.parent


def tensor_spec(name: str, shape, dtype: str = "float32", nbytes: int | None = None):
    itemsize = ITEMSIZE.get(dtype, 4)
    size = int(np.prod(shape)) * itemsize
    return pb.TensorSpec(name=name, dtype=dtype, global_shape=shape, shards=[
        pb.ShardSpec(index=[pb.Slice(start=0, stop=d) for d in shape],
                     nbytes=size if nbytes is None else nbytes)])


def register(stub, job="job", rank=0, world_size=1, tensors=None):
    tensors = tensors or [tensor_spec("w", (4, 4))]
    return stub.Register(pb.RegisterRequest(job=job, rank=rank, world_size=world_size,
                                            tensors=tensors), timeout=10)


def run_example(name: str, *flags: str, timeout: float = 600) -> tuple[int, dict]:
    """Runs ``examples/<name>`` with ``flags``; its exit code and its last line's JSON."""
    example = Path(__file__).resolve().parent.parent / "examples" / name
    proc = subprocess.run([sys.executable, str(example), *flags],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def mapped_bytes(path: str, fields: tuple[str, ...]) -> int:
    """The sum of ``fields`` (``"Rss:"``, ``"ShmemPmdMapped:"``, ...) over this process's
    mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
                inside = parts[-1] == path  # a mapping's header line
            elif inside and parts[0] in fields:
                total += int(parts[1]) << 10
    return total
