"""The durable tier's write: a daemon writing a committed step as one Orbax checkpoint,
against Orbax saving the same state, and the memory each takes meanwhile.

Usage: python benchmarks/durable_write.py [--json] [--quick] [--mb 1024] [--rounds 5]
       [--store s3|gcs | --durable-url s3://BUCKET/PREFIX | gs://BUCKET/PREFIX]

With ``--store`` or ``--durable-url`` the durable tier is an object store and the
baseline runs on the same store: raw TensorStore on S3, Orbax's save and restore on GCS
(durable_store.py says what is timed).

One state pytree (bf16 params with float32 Adam moments, 12 leaves, rows
sharded over 4 CPU devices, as in restore.py) is written by both modes,
interleaved round by round (bench_common.measure), each in GB/s of the
state's bytes:

  durable_write  the state snapshotted into a daemon (--durable-dir on tmpfs,
                 --durable-every-steps 1) as a new step; timed from the
                 snapshot's commit (the daemon holds the copy, and may have
                 begun writing a moment before this process hears it) until
                 the daemon's Status lists the step as durable: written through
                 TensorStore, finalized as one Orbax checkpoint, published.
                 This runs in the daemon's background, off the training step.
  orbax_save     orbax.checkpoint.StandardCheckpointer().save of the same state
                 into a tmpfs folder, until wait_until_finished(): Orbax's own
                 save, end to end, in this process.

Memory, per mode and round: how far the writing process's anonymous memory
(RssAnon: its heap, TensorStore's buffers; not shared-memory segments, which
hold the copy itself) rose over its level before the round, at its peak,
sampled every 5 ms: the daemon's for durable_write, this process's for
orbax_save. Reported as the median and the most over the rounds, in MB, and
the most it reached over its level before the first (warm-up) round: what a
writer keeps between rounds (glibc's arenas) counts there.

Checked: the last step each mode wrote, restored with plain Orbax into the
state's shardings, equals the state bit for bit.
"""

import argparse
import os
import shutil
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common
import durable_store

from bubblesnap.testing import DaemonProcess, reaped_tempdir, wait_for

MODES = ["durable_write", "orbax_save"]
DEVICES = 4
JOB = "durable-write"
#: How often the anonymous memory of the writing process is read.
_SAMPLE_SECONDS = 0.005
#: How often the daemon is asked whether the step is durable yet (its Status answer
#: takes the daemon's CPU: asked every 5 ms, it slowed the write it waited for).
_POLL_SECONDS = 0.02
#: Steps each mode keeps written (the daemon's --keep and --durable-keep, Orbax's folders).
_KEEP = 2


def anon_bytes(pid) -> int:
    """The process's anonymous resident memory (its RssAnon), in bytes."""
    return common.proc_bytes(pid, "RssAnon")


class AnonPeak:
    """The most a process's RssAnon rose over its level at the start, read on a thread
    every ``_SAMPLE_SECONDS`` until the block ends (``grown`` then holds it, and
    ``peak`` the most it was)."""

    def __init__(self, pid):
        self._pid, self._stop = pid, threading.Event()

    @property
    def grown(self) -> int:
        return self.peak - self._start

    def __enter__(self):
        self._start = self.peak = anon_bytes(self._pid)

        def sample():
            while not self._stop.is_set():
                self._sample()
                time.sleep(_SAMPLE_SECONDS)
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_):
        self._stop.set()
        self._thread.join()
        self._sample()
        return False

    def _sample(self) -> None:
        self.peak = max(self.peak, anon_bytes(self._pid))


class Bench:
    """This process holding the state and a client of the daemon; Orbax's checkpointer."""

    def __init__(self, state, daemon: DaemonProcess, root: str, durable_dir: str):
        import orbax.checkpoint as ocp

        from bubblesnap.clients.jax import ClientOptions, SnapshotClient
        self.state, self._daemon, self._root = state, daemon, root
        self._durable_dir = durable_dir
        self._client = SnapshotClient(JOB, options=ClientOptions(daemon=daemon.address))
        self._checkpointer = ocp.StandardCheckpointer()
        self.step = 0
        self.orbax_paths: list[str] = []  # the folders Orbax's save wrote, oldest first
        self._saves = 0
        self.anon_grown = {mode: [] for mode in MODES}
        # each writer's RssAnon before the first round, and the most it reached since:
        # what a writer keeps between rounds (glibc's arenas) counts here too
        self.anon_start = {"durable_write": anon_bytes(daemon.proc.pid),
                           "orbax_save": anon_bytes(os.getpid())}
        self.anon_peak = dict(self.anon_start)

    def _durable_steps(self) -> list[int]:
        from bubblesnap.protos import daemon_pb2 as pb
        status = self._daemon.stub.Status(pb.StatusRequest(job=JOB), timeout=10)
        return list(status.jobs[0].durable_steps) if status.jobs else []

    def durable_write(self) -> float:
        self.step += 1
        step = self.step
        with AnonPeak(self._daemon.proc.pid) as peak:
            result = self._client.snapshot(step, self.state, wait=True)
            if result is None or not result.taken:
                raise RuntimeError(f"step {step} was not taken: {getattr(result, 'reason', '')}")
            started = time.perf_counter()
            wait_for(lambda: step in self._durable_steps(), f"step {step} durable", 600,
                     failed=self._daemon_gone, interval=_POLL_SECONDS)
            spent = time.perf_counter() - started
            # The daemon removes the step --durable-keep behind after publishing this
            # one: waited for here, off the clock, so that no other mode's clock runs
            # beside it (Orbax's save removes its oldest folder off its clock too).
            retired = os.path.join(self._durable_dir, JOB, f"step_{step - _KEEP}")
            wait_for(lambda: not os.path.exists(retired), f"{retired} removed", 600,
                     failed=self._daemon_gone, interval=_POLL_SECONDS)
        self._note("durable_write", peak)
        return spent

    def _daemon_gone(self) -> str | None:
        code = self._daemon.proc.poll()
        return None if code is None else f"the daemon exited with code {code}"

    def _note(self, mode: str, peak: AnonPeak) -> None:
        self.anon_grown[mode].append(peak.grown)
        self.anon_peak[mode] = max(self.anon_peak[mode], peak.peak)

    def orbax_save(self) -> float:
        self._saves += 1
        path = os.path.join(self._root, f"orbax-{self._saves}")
        with AnonPeak(os.getpid()) as peak:
            started = time.perf_counter()
            self._checkpointer.save(path, self.state)
            self._checkpointer.wait_until_finished()
            spent = time.perf_counter() - started
        self.orbax_paths.append(path)
        # Kept as the daemon keeps its steps (--durable-keep 2), the oldest removed after
        # the new one is written: removed before, its memory would be the next save's warm
        # pages (a VM whose balloon takes freed memory back makes fresh pages slow to
        # touch: docs/development/benchmarks.md, "What this VM's memory does").
        for old in self.orbax_paths[:-_KEEP]:
            shutil.rmtree(old)
        del self.orbax_paths[:-_KEEP]
        self._note("orbax_save", peak)
        return spent

    def matches(self) -> dict[str, bool]:
        """Whether the last step each mode wrote restores, through plain Orbax, bit for bit."""
        target = common.restore_target(self.state)
        paths = {"durable_write": os.path.join(self._durable_dir, JOB, f"step_{self.step}"),
                 "orbax_save": self.orbax_paths[-1]}
        return {mode: common.same_state(self.state, self._checkpointer.restore(path, target))
                for mode, path in paths.items()}

    def close(self) -> None:
        try:
            self._client.close()
        finally:
            self._checkpointer.close()


def print_durable_write_table(report: dict) -> None:
    common.print_table(report, f"durable write of a {report['state_bytes'] / 1e6:.0f} MB "
                       f"state, {report['rounds']} rounds", report["matches"])
    for mode, row in report["anon_grown_mb"].items():
        print(f"  {mode:15s} anonymous memory grew {row['median']:.0f} MB a round "
              f"(most {row['max']:.0f} MB); its peak over its level before the first: "
              f"{report['anon_peak_over_start_mb'][mode]:.0f} MB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=1024, help="state size in MB (default 1024)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    durable_store.add_arguments(parser, "the daemon's write and restore there against raw "
                                "TensorStore (s3) or Orbax's own save and restore (gs)")
    args = common.parse_args(parser, quick={"mb": 16, "rounds": 1})
    common.exit_on_sigterm()
    common.force_cpu_devices(DEVICES)
    import jax

    if args.store or args.durable_url:
        state = common.make_state(int(args.mb * 1e6), DEVICES)
        state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
        report = durable_store.run(args, state, state_bytes, 4 * state_bytes + (256 << 20))
        common.report_out(report, args.json, durable_store.print_table)
        return 0 if all(report["matches"].values()) else 1
    # removed even if this process is killed (bubblesnap.testing's reaper)
    root = reaped_tempdir("bubblesnap-bench-durable-write-", "/dev/shm")
    durable_dir = os.path.join(root, "durable")
    daemon = bench = None
    try:
        state = common.make_state(int(args.mb * 1e6), DEVICES)
        state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
        # room for the steps kept (--keep 2) and the one being committed
        daemon = DaemonProcess("--memory-budget", str(4 * state_bytes + (256 << 20)),
                               "--durable-dir", durable_dir, "--durable-every-steps", "1",
                               "--keep", str(_KEEP), "--durable-keep", str(_KEEP))
        bench = Bench(state, daemon, root, durable_dir)
        seconds = common.measure(bench, MODES, args.rounds)
        matches = bench.matches()
        anon = {mode: values[1:] for mode, values in bench.anon_grown.items()}  # no warm-up
        over_start = {mode: bench.anon_peak[mode] - bench.anon_start[mode] for mode in MODES}
    finally:
        try:
            if bench is not None:
                bench.close()
        finally:
            if daemon is not None:
                daemon.stop()
            shutil.rmtree(root, ignore_errors=True)
    modes, medians = common.bandwidths(seconds, lambda _: state_bytes)
    ratio = medians["durable_write"] / medians["orbax_save"]
    report = {
        "benchmark": "durable_write", "state_bytes": state_bytes, "devices": DEVICES,
        "rounds": args.rounds, "modes": modes,
        "ratios": {"durable_write_vs_orbax_save": round(ratio, 3)},
        "meets_targets": {"durable_write_ge_orbax_save": ratio >= 1.0},
        "anon_grown_mb": {mode: {"median": round(statistics.median(values) / 1e6, 1),
                                 "max": round(max(values) / 1e6, 1)}
                          for mode, values in anon.items()},
        "anon_peak_over_start_mb": {mode: round(value / 1e6, 1)
                                    for mode, value in over_start.items()},
        "matches": matches,
        "storage": "tmpfs (/dev/shm): the daemon's durable tier and Orbax's folder",
        "machine_memory": common.machine_memory(),
    }
    common.report_out(report, args.json, print_durable_write_table)
    return 0 if all(matches.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
