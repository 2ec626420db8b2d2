"""The ways a stage can checkpoint, behind one interface, so they can be interleaved.

none         no checkpoint at all: the baseline step time
bubblesnap   BubbleSnapshotter: fetch step k inside iteration k+1's bubbles
eager        the same data path, copying the whole state right after each step
orbax_async  Orbax CheckpointManager with async checkpointing, saving every step
"""

import os
import time


class NoSnapshots:
    """Waits without doing anything in the bubbles."""

    def __init__(self):
        self._spans: list[tuple[str, float, float]] = []

    def spans(self) -> list[tuple[str, float, float]]:
        """(label, start, stop) of the checkpoint work done, for timelines."""
        return self._spans

    def begin_iteration(self, iteration: int) -> None:
        pass

    def no_bubble(self, position: int) -> None:
        pass

    def bubble(self, position: int, receive, arrived=None):
        return receive()[0]

    def end_iteration(self, iteration: int, state) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def snapshots(self) -> list[int]:
        return []

    def stats(self) -> dict:
        return {}


class DaemonSnapshots(NoSnapshots):
    """bubblesnap (or eager) through the local daemon; one job per mode."""

    def __init__(self, daemon: str, job: str, stage: int, stages: int, eager: bool):
        super().__init__()
        from bubblesnap.clients.jax import (
            BubbleSnapshotOptions,
            BubbleSnapshotter,
            ClientOptions,
            SnapshotClient,
        )
        self.client = SnapshotClient(job, rank=stage, world_size=stages,
                                     options=ClientOptions(daemon=daemon))
        self.snap = BubbleSnapshotter(self.client, stage, BubbleSnapshotOptions(eager=eager))

    def begin_iteration(self, iteration: int) -> None:
        self.snap.begin_iteration(iteration)

    def no_bubble(self, position: int) -> None:
        self.snap.no_bubble(position)

    def bubble(self, position: int, receive, arrived=None):
        return self.snap.bubble(position, receive, arrived)

    def end_iteration(self, iteration: int, state) -> None:
        self.snap.end_iteration(iteration, state)

    def flush(self) -> None:
        self.snap.flush()

    def spans(self):
        return [("spill" if r.spilled else "chunk", r.start, r.stop) for r in self.snap.records]

    def snapshots(self) -> list[int]:
        return list(self.snap.commits_acknowledged)

    def stats(self) -> dict:
        records = self.snap.records
        return {"overrun_seconds": self.snap.overrun_seconds,
                "bubble_copy_seconds": sum(r.stop - r.start for r in records if not r.spilled),
                "spill_seconds": sum(r.stop - r.start for r in records if r.spilled),
                "copied_bytes": sum(r.nbytes for r in records)}

    def close(self) -> None:
        self.snap.close()
        self.client.close()


class OrbaxAsync(NoSnapshots):
    """Orbax's CheckpointManager, async, saving every step to tmpfs, keeping two."""

    def __init__(self, directory: str):
        super().__init__()
        import orbax.checkpoint as ocp
        self._ocp = ocp
        self._saved: list[int] = []
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

    def snapshots(self) -> list[int]:
        return list(self._saved)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
