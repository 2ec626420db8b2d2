"""The JAX client: snapshot a pytree of jax.Arrays into the daemon, restore it back."""

import dataclasses
import functools
import time

import jax
import numpy as np

from bubblesnap.clients.daemon_client import DaemonClient
from bubblesnap.clients.jax import _layout, _transfer
from bubblesnap.clients.options import ClientOptions
from bubblesnap.clients.results import RestoreError, SnapshotResult


@dataclasses.dataclass(frozen=True)
class Restored:
    """A restored state: the step it was taken at, the pytree, how long it took, and
    where the daemon found it (``memory``, ``peer`` or ``durable``)."""

    step: int
    state: object
    seconds: float
    source: str = "memory"


class SnapshotClient(DaemonClient):
    """Snapshots and restores one rank's training state through the local daemon.

    Typical use, once per training step::

        client = SnapshotClient("my-job")
        for step in range(start, steps):
            state = train_step(state, batch)
            client.snapshot(step, state)

    and after a crash::

        restored = client.restore(abstract_state)   # jax.ShapeDtypeStruct leaves with shardings
        state, start = restored.state, restored.step + 1

    ``snapshot`` never raises for daemon trouble and never waits longer than
    its deadline: it returns a :class:`SnapshotResult` saying what happened.

    With data parallelism, give each rank its ``replica_group`` (the ranks
    whose state equals its own, itself included): the group's lowest rank
    copies the state, the others' ``snapshot`` copies nothing and their
    ``restore`` gets the lowest rank's copy.

    The training log (``log``, ``wait_log``, ``read_log``), ``wait``,
    ``status`` and ``close`` are :class:`DaemonClient`'s.
    """

    def __init__(self, job: str, rank: int = 0, world_size: int = 1,
                 options: ClientOptions = ClientOptions(), replica_group=()):
        super().__init__(job, rank, world_size, options, replica_group)
        self._specs = _layout.SpecCache()

    def snapshot(self, step: int, state, wait: bool = False) -> SnapshotResult:
        """Copies ``state`` (step ``step``) into the daemon's memory.

        Holds training for the device-to-host fetch and one memcpy; the daemon
        checksums and commits in the background unless ``wait`` is set. A
        replica that is not its group's copier fetches nothing
        (``SnapshotResult.copied_by``).
        """
        names, leaves, _ = _layout.flatten(state)
        return self._session.snapshot(step, self._specs.specs(names, leaves),
                                      lambda: _transfer.fetch_to_host(leaves), wait=wait)

    def restore(self, target, step: int | None = None, alone: bool = False) -> Restored:
        """Restores the latest committed step (or ``step``) into ``target``'s structure.

        ``target`` is a pytree like the saved state whose leaves are
        jax.Arrays or jax.ShapeDtypeStructs; each restored array gets the
        leaf's sharding (default: the first local device). Raises
        :class:`RestoreError` when nothing restorable is held or the layout
        does not match.

        Restoring a step resumes the whole job from it: with peers or a
        durable tier, the daemons drop every later copy as the abandoned
        run's (a lone daemon keeps them). ``alone=True``
        says this rank alone goes back (a stage replaying from boundary logs
        while the others keep their state), and later copies stay.
        """
        started = time.perf_counter()
        names, leaves, treedef = _layout.flatten(target)
        raw = self._session.restore(step, alone)
        by_name = {t.name: i for i, t in enumerate(raw.tensors)}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise RestoreError(f"step {raw.step} has no tensors {missing[:5]}; it holds "
                               f"{list(by_name)[:5]}...: restore into the state structure it "
                               "was saved from")
        arrays = []
        for name, leaf in zip(names, leaves, strict=True):
            tensor_index = by_name[name]
            spec = raw.tensors[tensor_index]
            dtype = np.dtype(spec.dtype)
            shape = tuple(spec.global_shape)
            if shape != tuple(leaf.shape) or dtype != np.dtype(leaf.dtype):
                raise RestoreError(f"{name!r} was saved as {dtype.name}{list(shape)}; the target "
                                   f"asks for {np.dtype(leaf.dtype).name}{list(leaf.shape)}")
            stored = {}
            for shard_index, shard in enumerate(spec.shards):
                index = tuple((s.start, s.stop) for s in shard.index)
                stored[index] = raw.shards[(tensor_index, shard_index)].view(dtype).reshape(
                    [b - a for a, b in index])
            sharding = getattr(leaf, "sharding", None) or jax.sharding.SingleDeviceSharding(
                jax.local_devices()[0])
            try:
                index_of = functools.partial(_layout.normalize_index, shape=shape)
                arrays.append(_transfer.place(shape, dtype, sharding, stored, index_of))
            except ValueError as err:
                raise RestoreError(f"{name!r}: {err}") from None
        state = jax.tree_util.tree_unflatten(treedef, arrays)
        return Restored(raw.step, state, time.perf_counter() - started, raw.source)
