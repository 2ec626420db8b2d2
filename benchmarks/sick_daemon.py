"""A training loop saving every step through bubblesnap's CheckpointManager while its daemon
is frozen (SIGSTOP, as a paused VM or a stuck host), then thawed: how long training steps
took during the freeze, against the same loop's steps with the daemon well.

Usage: python benchmarks/sick_daemon.py [--json] [--quick] [--size-mb 16]
[--freezes 4,20] [--steps 40] [--modes memory,persisted]

The loop is a Flax ``TrainState`` (optax Adam, float32 parameters, about
``--size-mb`` with its moments) updated by one jitted step per iteration and saved every
step, in one of two modes:

- ``memory``: snapshotted into the daemon's memory only (``memory_interval_steps=1``;
  the policy's own steps are far apart). The goals (issue 22): no step during a freeze
  longer than 0.2 s plus its compute, a snapshot committed within 2 s after the thaw.
- ``persisted``: every step kept by the policy (``save_interval_steps=1``,
  ``max_to_keep=3``) in a folder inside the daemon's durable tier, so the daemon writes
  each one. A save whose daemon does not answer within its bound
  (ClientOptions.persist_wait_*: a few times the daemon's recent writes, at least 2 s)
  is written by Orbax in the trainer. Beside it, the same loop with plain Orbax's
  manager (async, every step) gives the cost of Orbax's own save. The goal (issue 45):
  no step during a freeze longer than the bound plus a whole save by plain Orbax (its
  write waited for) plus the baseline's step, every
  step the policy keeps finalized once (no temporary folder left), the restore bit for
  bit.

First ``--steps`` steps with the daemon well (the baseline); then, for each freeze
length, the daemon is stopped for that many seconds while the loop goes on, and
continued. Reported per freeze: the slowest step during the freeze and its excess over
the baseline's median, the saves the daemon did not take, and the time from the thaw
until a step saved after it was committed by the daemon. At the end the latest step is
restored and compared, bit for bit.
"""

import argparse
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common
import grpc

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.testing import DaemonProcess

#: The policy's own steps in the memory mode (written to disk): the first, then none.
PERSIST_EVERY = 1_000_000
#: The goals the memory mode's report checks.
MAX_EXCESS_SECONDS, MAX_THAW_TO_COMMIT_SECONDS = 0.2, 2.0
MODES = ("memory", "persisted")


class Loop:
    """The training loop and its manager (``manager``: "bubblesnap" or "orbax"; ``mode``:
    "memory" or "persisted"); ``step()`` runs one iteration, saving it."""

    def __init__(self, size_bytes: int, address: str, directory: str, mode: str,
                 manager: str = "bubblesnap"):
        import jax
        import jax.numpy as jnp
        import orbax.checkpoint as ocp

        from bubblesnap.clients.jax import (
            CheckpointManager,
            CheckpointManagerOptions,
            ClientOptions,
        )

        self._jax, self._args, self.directory = jax, ocp.args, directory
        params = {f"w{i}": jnp.full((size_bytes // 48,), float(i), jnp.float32)
                  for i in range(4)}  # with Adam's two moments: about size_bytes
        self.state, self._train_step = common.adam_train_state(params)
        policy = {"save_interval_steps": PERSIST_EVERY, "memory_interval_steps": 1,
                  "max_to_keep": 2} if mode == "memory" else {"max_to_keep": 3}
        if manager == "orbax":
            policy.pop("memory_interval_steps", None)
            self.manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
                **policy))
        else:
            self.manager = CheckpointManager(directory, options=CheckpointManagerOptions(
                **policy, client=ClientOptions(daemon=address)))
        #: the daemon's job of the manager's one item
        self.job = f"{os.path.realpath(directory)}/default"
        self.number, self.skipped = 0, 0

    def step(self) -> tuple[float, bool]:
        """One iteration, its save included: (seconds, whether the save was taken)."""
        started = time.perf_counter()
        self.state = self._jax.block_until_ready(self._train_step(self.state))
        saved = self.manager.save(self.number, args=self._args.StandardSave(self.state))
        self.number += 1
        self.skipped += not saved
        return time.perf_counter() - started, saved

    def whole_save(self) -> float:
        """One iteration's save waited for until it is on disk: a whole save's cost."""
        self.manager.wait_until_finished()
        started = time.perf_counter()
        self.step()
        self.manager.wait_until_finished()
        return time.perf_counter() - started

    def wait_bound(self) -> float:
        """How long a persisted save waits for its daemon before Orbax writes it here."""
        tier = self.manager._tier
        return tier.persist_wait("default")

    def restore_matches(self) -> bool:
        self.manager.wait_until_finished()
        latest = self.manager.latest_step()
        target = common.restore_target(self.state)
        restored = self.manager.restore(latest, args=self._args.StandardRestore(target))
        return latest == self.number - 1 and common.same_state(self.state.params,
                                                                restored.params)

    def finalized_once(self) -> bool:
        """The steps kept are whole Orbax steps, with nothing of a save left beside them
        (no temporary folder: none finalized twice, none half)."""
        names = os.listdir(self.directory)
        return all(name.isdigit() for name in names) and \
            sorted(int(n) for n in names) == self.manager.all_steps()


def committed_step(daemon: DaemonProcess, job: str) -> int:
    """The newest step the daemon committed (-1: none, or no answer within 1 s)."""
    try:
        [job] = daemon.stub.Status(pb.StatusRequest(job=job), timeout=1).jobs
    except grpc.RpcError:  # not answered within the second, or the job not registered yet
        return -1
    return job.latest_committed_step


def written_by_trainer(daemon: DaemonProcess) -> int:
    """Saves the daemon says its trainer wrote itself (it did not answer in time)."""
    notes = daemon.stub.Status(pb.StatusRequest(), timeout=10).durable_notes
    return sum("written by its trainer" in note for note in notes)


def freeze(loop: Loop, daemon: DaemonProcess, seconds: float, baseline: float) -> dict:
    """The loop through a freeze of ``seconds`` and until a step saved after the thaw is
    committed."""
    skipped_before = loop.skipped
    daemon.freeze()  # returns once every thread stopped
    frozen_at, times = time.monotonic(), []
    try:
        while time.monotonic() - frozen_at < seconds:
            times.append(loop.step()[0])
    finally:
        daemon.thaw()
    thawed, first_after = time.monotonic(), loop.number
    first_taken = None
    while committed_step(daemon, loop.job) < first_after:
        saved = loop.step()[1]
        if saved and first_taken is None:
            first_taken = time.monotonic() - thawed
        if time.monotonic() - thawed > 60:
            break  # reported as a miss
    thaw_to_commit = time.monotonic() - thawed
    return {"freeze_seconds": seconds, "steps": len(times),
            "skipped_saves": loop.skipped - skipped_before,
            "median_step_seconds": statistics.median(times),
            "max_step_seconds": max(times),
            "max_excess_seconds": max(times) - baseline,
            "first_save_taken_after_thaw_seconds": first_taken,
            "thaw_to_commit_seconds": thaw_to_commit}


def run_mode(mode: str, args, root: str) -> dict:
    daemon = DaemonProcess("--durable-dir", root, "--keep", "2")
    try:
        orbax = None
        if mode == "persisted":  # plain Orbax's own save of the same state, every step
            plain = Loop(int(args.size_mb * 1e6), daemon.address, os.path.join(root, "orbax"),
                         mode, manager="orbax")
            [plain.step() for _ in range(5)]
            plain_times = [plain.step()[0] for _ in range(args.steps)]
            orbax = {"steps": len(plain_times),
                     "median_step_seconds": statistics.median(plain_times),
                     "max_step_seconds": max(plain_times),
                     "save_seconds": statistics.median(plain.whole_save() for _ in range(5))}
            plain.manager.close()
        loop = Loop(int(args.size_mb * 1e6), daemon.address, os.path.join(root, mode), mode)
        for _ in range(5):  # compiled, registered, the reservation in hand
            loop.step()
        times = [loop.step()[0] for _ in range(args.steps)]
        baseline = statistics.median(times)
        freezes = [freeze(loop, daemon, float(s), baseline) for s in args.freezes.split(",")]
        row = {"baseline": {"steps": len(times), "median_step_seconds": baseline,
                            "max_step_seconds": max(times)}, "freezes": freezes,
               "restore_matches": loop.restore_matches()}
        if mode == "memory":
            row["checks"] = {
                "step_le_0.2s_over_baseline": all(
                    f["max_excess_seconds"] <= MAX_EXCESS_SECONDS for f in freezes),
                "commit_within_2s_of_thaw": all(
                    f["thaw_to_commit_seconds"] <= MAX_THAW_TO_COMMIT_SECONDS
                    for f in freezes)}
        else:
            bound = loop.wait_bound()
            row.update(orbax_baseline=orbax, wait_bound_seconds=bound,
                       written_by_trainer=written_by_trainer(daemon))
            row["checks"] = {
                "step_le_bound_plus_orbax_save": all(
                    f["max_step_seconds"] <= bound + orbax["save_seconds"] + baseline
                    for f in freezes),
                "every_kept_step_finalized_once": loop.finalized_once()}
        row["state_mb"] = sum(x.nbytes for x in loop._jax.tree.leaves(loop.state)) / 1e6
        loop.manager.close()
        return row
    finally:
        daemon.stop()


def print_sick_table(report: dict) -> None:
    for mode, row in report["modes"].items():
        print(f"{mode}: {row['state_mb']:.0f} MB state, baseline step "
              f"{row['baseline']['median_step_seconds'] * 1e3:.1f} ms (daemon well)")
        if "orbax_baseline" in row:
            print(f"  plain Orbax saving every step: median "
                  f"{row['orbax_baseline']['median_step_seconds'] * 1e3:.1f} ms, slowest "
                  f"{row['orbax_baseline']['max_step_seconds'] * 1e3:.1f} ms, a whole save "
                  f"{row['orbax_baseline']['save_seconds'] * 1e3:.1f} ms; wait bound "
                  f"{row['wait_bound_seconds']:.2f} s; {row['written_by_trainer']} saves "
                  "written by the trainer")
        for f in row["freezes"]:
            print(f"  frozen {f['freeze_seconds']:g} s: {f['steps']} steps, slowest "
                  f"{f['max_step_seconds'] * 1e3:.1f} ms (+{f['max_excess_seconds'] * 1e3:.1f}"
                  f" ms), {f['skipped_saves']} saves skipped, committed "
                  f"{f['thaw_to_commit_seconds']:.2f} s after the thaw")
        print(f"  checks: {row['checks']}, restore matches: {row['restore_matches']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=16, help="state size (default 16)")
    parser.add_argument("--freezes", default="4,20",
                        help="freeze lengths in seconds, comma-separated (default 4,20)")
    parser.add_argument("--steps", type=int, default=40,
                        help="baseline steps with the daemon well (default 40)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"which of {', '.join(MODES)} to run, comma-separated "
                             "(default both)")
    args = common.parse_args(parser, quick={"size_mb": 1, "freezes": "1", "steps": 10})
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes takes {', '.join(MODES)}, not {args.modes!r}")
    common.exit_on_sigterm()
    root = os.path.join("/dev/shm", f"bubblesnap-bench-sick-{os.getpid()}")
    try:
        report = {"benchmark": "sick_daemon",
                  "modes": {mode: run_mode(mode, args, os.path.join(root, mode))
                            for mode in modes}}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    common.report_out(report, args.json, print_sick_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
