"""The JAX client: snapshot a pytree of jax.Arrays into the daemon, restore it back."""

import dataclasses
import time

import jax
import numpy as np

from bubblesnap.clients.daemon_client import DaemonClient
from bubblesnap.clients.jax import _layout, _transfer
from bubblesnap.clients.options import ClientOptions
from bubblesnap.clients.results import RestoreError, SnapshotResult


@dataclasses.dataclass(frozen=True)
class Restored:
    """A restored state: the step it was taken at, the pytree, how long it took, where
    the daemon found it (``memory``, ``peer`` or ``durable``), and the world size
    the step was taken with (0: the daemon did not say), and where the time went
    (``phases``, name -> seconds: ``RawStep.phases`` and ``place``, the arrays
    made from the segment's bytes)."""

    step: int
    state: object
    seconds: float
    source: str = "memory"
    world_size: int = 0
    phases: dict = dataclasses.field(default_factory=dict)


class SnapshotClient(DaemonClient):
    """Snapshots and restores one rank's training state through the local daemon.

    Typical use, once per training step::

        client = SnapshotClient("my-job", jax.process_index(), jax.process_count())
        for step in range(start, steps):
            state = train_step(state, batch)
            client.snapshot(step, state)

    and after a crash::

        restored = client.restore(abstract_state)   # jax.ShapeDtypeStruct leaves with shardings
        state, start = restored.state, restored.step + 1

    ``snapshot`` never raises for daemon trouble and never waits longer than
    its deadline: it returns a :class:`SnapshotResult` saying what happened.

    Multi-host (one process per host under ``jax.distributed``, ``rank`` the
    process index): each distinct region of a global array is copied once
    in the whole job, by the process whose device holds it with replica id
    0, and a restore asks for the regions the target shardings need on this
    process's devices, wherever they were copied: another process count or
    mesh restores as well.

    With data parallelism outside one global mesh (ranks that each hold a
    whole copy of the same state in their own arrays), give each rank its
    ``replica_group`` (the ranks whose state equals its own, itself
    included): the group's lowest rank copies the state, the others'
    ``snapshot`` copies nothing and their ``restore`` gets the lowest rank's
    copy.

    The training log (``log``, ``wait_log``, ``read_log``), ``wait``,
    ``status`` and ``close`` are :class:`DaemonClient`'s.
    """

    def __init__(self, job: str, rank: int = 0, world_size: int = 1,
                 options: ClientOptions = ClientOptions(), replica_group=()):
        super().__init__(job, rank, world_size, options, replica_group)
        self._specs = _layout.SpecCache(world_size)

    def register(self, state) -> None:
        """Registers the layout of ``state`` (a pytree of jax.Arrays) with the daemon, as
        :meth:`snapshot` does, without copying: a rank must be registered before it
        logs, so one that logs before its first snapshot calls this first. Raises
        :class:`LogError` when the daemon refuses."""
        names, leaves, _ = _layout.flatten(state)
        self._declare(self._specs.specs(names, leaves))

    def snapshot(self, step: int, state, wait: bool | str = False) -> SnapshotResult:
        """Copies this process's part of ``state`` (step ``step``) into the daemon's memory.

        Holds training for the device-to-host fetch and one memcpy. ``wait``:

        - False (default): returns then; the daemon checksums and commits in
          the background (``waited_for == ""``, ``committed`` None).
        - True or ``"rank"``: also waits until this rank's copy is checked
          and kept by its daemon (LOCAL): after a crash of this process it
          is there. It says nothing of the other ranks (``committed`` is
          True only if the job had committed the step by then).
        - ``"job"``: then waits until the whole job committed the step, at
          most ``ClientOptions.commit_timeout_seconds``: every rank's copy is
          LOCAL (with its replicas, with peers), so a restore of the job can
          pick it (``committed`` True; False after the timeout).

        A process that holds no replica-0 shard of some array copies none of
        it (another process does). A data-parallel replica that is not its
        group's copier fetches nothing (``SnapshotResult.copied_by``).
        """
        names, leaves, _ = _layout.flatten(state)
        return self.snapshot_leaves(step, names, leaves, wait)

    def snapshot_leaves(self, step: int, names, leaves, wait: bool | str = False
                        ) -> SnapshotResult:
        """:meth:`snapshot` of leaves already flattened: ``names[i]`` is the tensor name
        of ``leaves[i]`` (a jax.Array, a numpy array or a ``_layout.HostValue``)."""
        return self._session.snapshot(step, self._specs.specs(names, leaves),
                                      lambda: _transfer.fetch_to_host(leaves), wait=wait)

    def restore(self, target, step: int | None = None, alone: bool = False) -> Restored:
        """Restores the latest committed step (or ``step``) into ``target``'s structure.

        ``target`` is a pytree like the saved state whose leaves are
        jax.Arrays or jax.ShapeDtypeStructs; each restored array gets the
        leaf's sharding (default: the first local device). The daemon is
        asked, per leaf, for the regions that sharding puts on this
        process's devices, and serves them from wherever the job copied them
        (this daemon, a peer, the durable tier): a job-wide array restores
        into any mesh and process count; a rank's own tensors only into the
        world size they were taken with. Each device gets one host-to-device
        transfer (the CPU backend aliases the daemon's read-only memory).
        Raises :class:`RestoreError` when nothing restorable is held, the
        target does not match the step, or the daemon's answer lacks a
        region asked.

        Restoring a step resumes the whole job from it: with peers or a
        durable tier, the daemons drop every later copy as the abandoned
        run's (a lone daemon keeps them). ``alone=True``
        says this rank alone goes back (a stage replaying from boundary logs
        while the others keep their state), and later copies stay.
        """
        names, leaves, treedef = _layout.flatten(target)
        found = self.restore_leaves(names, leaves, step, alone)
        return dataclasses.replace(found, state=jax.tree_util.tree_unflatten(treedef,
                                                                             found.state))

    def restore_leaves(self, names, targets, step: int | None = None, alone: bool = False,
                       host=frozenset()) -> Restored:
        """:meth:`restore` of leaves already flattened: tensor ``names[i]`` into the
        shape, dtype and sharding of ``targets[i]``; ``state`` is the list of arrays,
        in that order. A name in ``host`` comes back as a writable numpy array of the
        whole tensor instead of a jax.Array."""
        started = time.perf_counter()
        shardings = [None if name in host else _layout.target_sharding(leaf)
                     for name, leaf in zip(names, targets, strict=True)]
        needs = [({}, [tuple((0, d) for d in leaf.shape)]) if sharding is None else
                 _layout.needed_regions(leaf.shape, sharding)
                 for leaf, sharding in zip(targets, shardings, strict=True)]
        raw = self._session.restore(step, alone, tensors=[
            _layout.tensor_request(name, leaf, regions)
            for name, leaf, (_, regions) in zip(names, targets, needs, strict=True)])
        placing = time.perf_counter()
        arrays = []
        for t, (name, leaf, sharding, (per_device, regions)) in enumerate(
                zip(names, targets, shardings, needs, strict=True)):
            dtype, shape = np.dtype(leaf.dtype), tuple(leaf.shape)
            position = {region: r for r, region in enumerate(regions)}

            def host_of(region, t=t, dtype=dtype, position=position):
                return raw.shards[(t, position[region])].view(dtype).reshape(
                    [b - a for a, b in region])
            try:
                arrays.append(np.array(host_of(regions[0])) if sharding is None else
                              _transfer.place(shape, sharding, per_device, host_of))
            except ValueError as err:  # a region's bytes do not fit its shape
                raise RestoreError(f"step {raw.step}: {name!r}: {err}") from None
        done = time.perf_counter()
        return Restored(raw.step, arrays, done - started, raw.source, raw.world_size,
                        {**raw.phases, "place": done - placing})
