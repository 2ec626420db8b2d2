"""When the durable tier writes a step and which written steps it keeps: pure functions."""

import dataclasses

from bubblesnap.options import require


@dataclasses.dataclass(frozen=True, kw_only=True)
class DurableOptions:
    """When and where snapshots are written to durable storage (flags in brackets).

    Attributes:
      directory: where checkpoints go, a shared filesystem or a bucket mount
        all hosts see (``--durable-dir``). Empty: no durable tier.
      every_steps: write steps that are multiples of this
        (``--durable-every-steps``). Every daemon picks the same steps, so each
        one is whole for the job. 0: off.
      every_seconds: also write the next committed step once this long has
        passed since the last write (``--durable-every-seconds``). 0: off.
        Hosts decide independently, so a step chosen this way may be whole
        only once every host wrote it.
      keep: whole steps (written by every rank) kept; a rank's older steps are
        deleted (``--durable-keep``). Default 2.
    """

    directory: str = ""
    every_steps: int = 0
    every_seconds: float = 0.0
    keep: int = 2

    def __post_init__(self):
        require(self, "every_steps", self.every_steps >= 0, ">= 0", "--durable-every-steps")
        require(self, "every_seconds", self.every_seconds >= 0, ">= 0",
                "--durable-every-seconds")
        require(self, "keep", self.keep >= 1, "at least 1", "--durable-keep")
        require(self, "directory", not self.directory or bool(self.every_steps or
                                                               self.every_seconds),
                "given with --durable-every-steps or --durable-every-seconds (how often to "
                "write)", "--durable-dir")

    @property
    def enabled(self) -> bool:
        return bool(self.directory)


def should_write(step: int, seconds_since_last: float, options: DurableOptions) -> bool:
    """Whether a newly committed step goes to the durable tier."""
    if options.every_steps and step % options.every_steps == 0:
        return True
    return bool(options.every_seconds) and seconds_since_last >= options.every_seconds


def is_whole(world_size: int, written: dict[int, tuple[int, ...]]) -> bool:
    """Whether every rank of a step is written, itself or through the replica group of a
    written rank (``written``: rank -> the ranks its copy holds)."""
    covered = {member for rank, group in written.items() for member in (rank, *group)}
    return covered >= set(range(world_size))


def steps_to_retire(written_here: list[int], whole_steps: list[int], keep: int) -> list[int]:
    """A rank's written steps older than the ``keep`` newest whole steps.

    Counting only this rank's steps would be wrong: hosts that fall behind
    write different steps, and the step all ranks share could go.
    """
    if not whole_steps:
        return []
    floor = whole_steps[-keep:][0]
    return [s for s in written_here if s < floor]
