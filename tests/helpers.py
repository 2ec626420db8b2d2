"""Small builders shared by the tests."""

import numpy as np

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.service.layout import ITEMSIZE


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
