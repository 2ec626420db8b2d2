"""What a client's calls answer: the outcome of a snapshot, a restored step, and the errors."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class SnapshotResult:
    """What became of one snapshot request.

    Attributes:
      step: the training step.
      taken: this rank's bytes reached the daemon's memory (and, if the call
        waited, the daemon checked and kept them: the rank's copy is LOCAL).
      committed: what ``waited_for`` says was waited for:

        - ``waited_for == ""`` (``wait=False``): None, nothing was waited for
          (False when the snapshot failed: nothing to commit).
        - ``"rank"`` (``wait=True`` or ``"rank"``): the daemon answered this
          rank's commit. True when the whole job had committed the step by
          then; False says only "not yet" (other ranks, or the copies to
          peers, may still come: in a multi-process job only the last rank
          to commit sees True).
        - ``"job"`` (``wait="job"``): True once every rank's copy (and its
          replicas) made the step committed for the job; False when that did
          not happen within ``ClientOptions.commit_timeout_seconds``
          (``reason`` says so and names the latest committed step).
      reason: why no snapshot was taken, empty when it was; or, waiting for
        the job, why the step is not known committed.
      stall_seconds: how long the call held the training loop.
      copied_by: for a rank of a data-parallel replica group that is not its
        copier (lowest rank): the rank whose snapshot holds this state.
        Nothing was copied (``taken`` is False); None otherwise.
      waited_for: ``""``, ``"rank"`` or ``"job"``: what ``committed`` reports.
      phases: where the time went, name -> seconds (what is known: a
        snapshot staged at once has ``begin``, the segment reserved, and
        ``copy``, the bytes fetched and copied into it; a collected commit
        adds ``commit``, from sending it to the daemon's answer, its checks
        and record included). Empty when nothing was staged.
    """

    step: int
    taken: bool
    committed: bool | None = None
    reason: str = ""
    stall_seconds: float = 0.0
    copied_by: int | None = None
    waited_for: str = ""
    phases: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class RawStep:
    """A restored step before it is turned back into framework arrays.

    Attributes:
      step: the training step.
      tensors: the ``pb.TensorSpec`` of each tensor, in registration order
        (a restore by regions: the tensors asked, one shard per region asked).
      shards: (tensor index, shard index) -> read-only uint8 view of the
        daemon's segment.
      source: where the daemon found it: ``memory``, ``peer`` or ``durable``.
      world_size: the world size the step was taken with (0: not said).
      phases: where the time went, name -> seconds: ``call`` (the Restore
        call, the daemon's work included), ``map_early`` (mapping the segment
        while the daemon worked, inside ``call``), ``map`` (mapping it after the
        answer: none when the early mapping was the answer's),
        ``verify`` (with ``verify_restore``), and the daemon's own phases as
        ``daemon.<name>`` (e.g. ``daemon.receive``: a peer's bytes arriving).
    """

    step: int
    tensors: tuple
    shards: dict
    source: str = "memory"
    world_size: int = 0
    phases: dict = dataclasses.field(default_factory=dict)


class LogError(RuntimeError):
    """A training-log record could not be stored or read."""


class RestoreError(RuntimeError):
    """A restore could not be done; the message says why and what is held."""
