"""The ways a stage can checkpoint, as pipeline hooks, so they can be interleaved.

Each is a ``bubblesnap.clients.PipelineHooks`` (what stage.StageRunner calls)
with the reports pipeline_gpt.py gathers from every mode: spans, snapshots,
stats.

none         NoCheckpoints: no checkpoint at all, the baseline step time
bubblesnap   DaemonSnapshots: BubbleSnapshotter, fetch step k inside iteration k+1's bubbles
eager        DaemonSnapshots(eager=True): the same data path, copying the whole state
             right after each step
orbax_async  OrbaxAsync: Orbax CheckpointManager with async checkpointing, saving every step
"""

import os
import time

from bubblesnap.clients import NoSnapshots
from bubblesnap.clients.jax import (
    BubbleSnapshotOptions,
    BubbleSnapshotter,
    ClientOptions,
    SnapshotClient,
)


class NoCheckpoints(NoSnapshots):
    """Waits without doing anything in the bubbles, and has nothing to report."""

    def spans(self) -> list[tuple[str, float, float]]:
        """(label, start, stop) of the checkpoint work done, for timelines."""
        return []

    def snapshots(self) -> list[int]:
        """The steps checkpointed."""
        return []

    def stats(self) -> dict:
        """Numbers about the checkpoint work, by name."""
        return {}


class DaemonSnapshots(BubbleSnapshotter):
    """bubblesnap (or eager) through the local daemon; one job per mode. ``client`` is
    the stage's SnapshotClient, for restores and status."""

    def __init__(self, daemon: str, job: str, stage: int, stages: int, eager: bool):
        self.client = SnapshotClient(job, rank=stage, world_size=stages,
                                     options=ClientOptions(daemon=daemon))
        super().__init__(self.client, stage, BubbleSnapshotOptions(eager=eager))

    def spans(self):
        return [("spill" if r.spilled else "chunk", r.start, r.stop) for r in self.records]

    def snapshots(self) -> list[int]:
        return list(self.commits_acknowledged)

    def stats(self) -> dict:
        records = self.records
        return {"overrun_seconds": self.overrun_seconds,
                "bubble_copy_seconds": sum(r.stop - r.start for r in records if not r.spilled),
                "spill_seconds": sum(r.stop - r.start for r in records if r.spilled),
                "copied_bytes": sum(r.nbytes for r in records)}

    def close(self) -> None:
        super().close()
        self.client.close()


class OrbaxAsync(NoCheckpoints):
    """Orbax's CheckpointManager, async, saving every step to tmpfs, keeping two."""

    def __init__(self, directory: str):
        import orbax.checkpoint as ocp
        self._ocp = ocp
        self._saved: list[int] = []
        self._spans: list[tuple[str, float, float]] = []
        self.manager = ocp.CheckpointManager(
            os.path.abspath(directory), options=ocp.CheckpointManagerOptions(
                max_to_keep=2, enable_async_checkpointing=True))

    def end_iteration(self, iteration: int, state) -> None:
        started = time.perf_counter()
        self.manager.save(iteration, args=self._ocp.args.StandardSave(state))
        self._spans.append(("orbax", started, time.perf_counter()))
        self._saved.append(iteration)

    def flush(self) -> None:
        self.manager.wait_until_finished()

    def spans(self):
        return list(self._spans)

    def snapshots(self) -> list[int]:
        return list(self._saved)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
