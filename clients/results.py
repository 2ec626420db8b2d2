"""What a client's calls answer: the outcome of a snapshot, a restored step, and the errors."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class SnapshotResult:
    """What became of one snapshot request.

    Attributes:
      step: the training step.
      taken: the bytes reached the daemon's memory (and, if the call waited,
        the daemon committed them).
      committed: every rank of the job holds this step (None: not waited for).
      reason: why no snapshot was taken, empty when it was.
      stall_seconds: how long the call held the training loop.
      copied_by: for a rank of a data-parallel replica group that is not its
        copier (lowest rank): the rank whose snapshot holds this state.
        Nothing was copied (``taken`` is False); None otherwise.
    """

    step: int
    taken: bool
    committed: bool | None = None
    reason: str = ""
    stall_seconds: float = 0.0
    copied_by: int | None = None


@dataclasses.dataclass(frozen=True)
class RawStep:
    """A restored step before it is turned back into framework arrays.

    Attributes:
      step: the training step.
      tensors: the ``pb.TensorSpec`` of each tensor, in registration order.
      shards: (tensor index, shard index) -> read-only uint8 view of the
        daemon's segment.
      source: where the daemon found it: ``memory``, ``peer`` or ``durable``.
    """

    step: int
    tensors: tuple
    shards: dict
    source: str = "memory"


class LogError(RuntimeError):
    """A training-log record could not be stored or read."""


class RestoreError(RuntimeError):
    """A restore could not be done; the message says why and what is held."""
