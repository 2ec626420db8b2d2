"""Small builders shared by the tests."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.service.store.layout import ITEMSIZE
from bubblesnap.testing import free_port

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


def run_processes(module: str, count: int, *flags: str, timeout: float = 300) -> list[dict]:
    """Runs ``python -m module`` as ``count`` processes of one job (each with ``--index i
    --count n --coordinator 127.0.0.1:PORT``, for ``jax.distributed.initialize``), side
    by side; the last line's JSON of each. Fails with the output of one that fails."""
    coordinator = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the program sets its own
    procs = [subprocess.Popen([sys.executable, "-m", module, *flags, "--index", str(index),
                               "--count", str(count), "--coordinator", coordinator],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for index in range(count)]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, (out + err)[-4000:]
            outputs.append(json.loads(out.strip().splitlines()[-1]))  # gloo logs on stderr
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs
