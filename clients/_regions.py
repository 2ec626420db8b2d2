"""A restore by regions: the answer checked against what was asked, in request order.

A client asks for tensors region by region (``RestoreRequest.tensors``) and
the daemon answers one segment holding exactly those regions. Placing bytes
on the wrong device would be silent corruption, so nothing of the answer is
used until every region asked is found in it, under its tensor's name, with
the dtype and global shape asked. A daemon that predates restores by region
ignores the request and answers the rank's own copy; that is refused here
unless it happens to hold every region asked.
"""

from bubblesnap.clients.results import RawStep, RestoreError
from bubblesnap.protos import daemon_pb2 as pb


def _box(index) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.stop) for s in index)


def _describe(name: str, box) -> str:
    return f"{name!r} [{', '.join(f'{a}:{b}' for a, b in box)}]"


def in_request_order(requests, raw: RawStep) -> RawStep:
    """``raw`` with ``tensors`` the requested tensors (one shard per region asked) and
    ``shards`` keyed (request tensor, request region); raises RestoreError when
    the answer lacks a tensor or region asked or holds one as another dtype or shape."""
    by_name = {t.name: i for i, t in enumerate(raw.tensors)}
    tensors, shards = [], {}
    for t, request in enumerate(requests):
        found = by_name.get(request.name)
        if found is None:
            raise RestoreError(
                f"step {raw.step} has no tensors [{request.name!r}]; it holds "
                f"{list(by_name)[:5]}...: restore into the state structure it was saved from")
        held = raw.tensors[found]
        if held.dtype != request.dtype or list(held.global_shape) != list(request.global_shape):
            raise RestoreError(
                f"{request.name!r} was saved as {held.dtype}{list(held.global_shape)}; the "
                f"target asks for {request.dtype}{list(request.global_shape)}")
        where = {_box(shard.index): s for s, shard in enumerate(held.shards)}
        for r, region in enumerate(request.regions):
            box = _box(region.index)
            if box not in where:
                sent = ", ".join(_describe(held.name, _box(s.index)) for s in held.shards[:4])
                raise RestoreError(
                    f"step {raw.step}: the daemon's answer lacks {_describe(request.name, box)}, "
                    f"which this process's devices need; it sent {sent or 'no region'} of it. "
                    "A daemon that restores by regions sends exactly the regions asked; one "
                    "that predates it ignores them and sends the rank's own copy")
            shards[(t, r)] = raw.shards[(found, where[box])]
        tensors.append(pb.TensorSpec(
            name=held.name, dtype=held.dtype, global_shape=held.global_shape,
            job_wide=held.job_wide,
            shards=[pb.ShardSpec(index=region.index) for region in request.regions]))
    return RawStep(raw.step, tuple(tensors), shards, raw.source, raw.world_size, raw.phases)
