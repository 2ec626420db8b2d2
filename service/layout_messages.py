"""A validated layout and its slots as wire messages (daemon and peer protos share them)."""

from bubblesnap.protos import daemon_pb2 as pb


def tensor_specs(layout) -> list[pb.TensorSpec]:
    return [pb.TensorSpec(
        name=t.name, dtype=t.dtype, global_shape=t.global_shape,
        shards=[pb.ShardSpec(index=[pb.Slice(start=a, stop=b) for a, b in s.index],
                             nbytes=s.nbytes) for s in t.shards])
        for t in layout.tensors]


def slots(slot_tuples) -> list[pb.Slot]:
    return [pb.Slot(tensor=t, shard=s, offset=o, nbytes=n) for t, s, o, n in slot_tuples]
