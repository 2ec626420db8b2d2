"""Data-path bandwidth: staging into the daemon and restoring from it, against memcpy and Orbax.

One state pytree (default ~256 MB: bfloat16 params with float32 Adam moments,
12 leaves of a few sizes, on the JAX CPU backend) goes through every mode,
and each mode reports bytes/s (GB/s, 1e9 bytes/s) of that state:

  memcpy_warm    np.copyto of every leaf's bytes into one buffer touched before:
                 the physical limit for staging, which reuses warm segments.
  memcpy_fresh   the same copies into buffers freshly allocated each time, page
                 faults included: the limit for a restore, which must produce new arrays.
  stage_stall    client.snapshot(step, state, wait=False): what training is held for.
  stage_commit   snapshot + client.wait(): until the daemon checksummed and committed.
                 Both report their phases: begin (the segment reserved), copy (the
                 bytes fetched and copied in), and commit (sent until answered: the
                 daemon's hash and record).
  restore_local  client.restore(target) + block_until_ready (target has the shardings).
  orbax_save     StandardCheckpointer save into a fresh /dev/shm (tmpfs) directory,
                 until wait_until_finished() returns.
  orbax_restore  StandardCheckpointer restore of that checkpoint into the same target.

The machines are shared and noisy, so the modes run interleaved, one round
after another (the starting mode rotates each round), after one untimed
warm-up round, and the JSON reports median/min/max per mode and ratios of
medians measured in the same run (see DESIGN.md, "How we measure"). Before
each mode the process hands its free heap memory back to the OS (glibc
malloc_trim), so that "fresh" buffers, and the arrays a restore allocates,
really pay first-touch page faults as in a newly started trainer, instead of
reusing the pages the previous round freed.

Staging and restoring use two jobs of one daemon: "bench-stage" snapshots a
new step every time; "bench-restore" holds one step taken at start-up and is
restored every round. A segment once restored from is never recycled (the
restored arrays may alias it), so restoring from the staging job would push
its snapshots into new, first-touch segments; the split measures both in
steady state.

On the CPU backend a restore is zero-copy: the restored jax.Arrays alias the
daemon's segment, so restore_local is bounded by the daemon's checksum pass
and mapping the segment, not by a copy. On an accelerator it is one
host-to-device transfer per shard.

Usage: python benchmarks/datapath.py [--json] [--quick] [--size-mb 256] [--repeats 5]
       [--devices 1]
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

import bench_common as common
import numpy as np

from bubblesnap.testing import DaemonProcess

MODES = ("memcpy_warm", "memcpy_fresh", "stage_stall", "stage_commit", "restore_local",
         "orbax_save", "orbax_restore")


def check_snapshot(result, what: str) -> None:
    if result is None or not result.taken:
        raise RuntimeError(f"{what} was not taken: {getattr(result, 'reason', 'no result')}")


class Bench:
    """The state, its clients and checkpointer, and one timing function per mode."""

    def __init__(self, state, address: str, orbax_dir: str):
        import orbax.checkpoint as ocp

        from bubblesnap.clients.jax import ClientOptions, SnapshotClient
        self.state = state
        self.target = common.restore_target(state)
        self.shards = list(common.shard_bytes(state).values())
        self.warm = np.empty(sum(s.nbytes for s in self.shards), np.uint8)
        self.warm.fill(0)
        options = ClientOptions(daemon=address)
        self.stager = SnapshotClient("bench-stage", options=options)
        self.restorer = SnapshotClient("bench-restore", options=options)
        check_snapshot(self.restorer.snapshot(0, state, wait=True), "the restore job's snapshot")
        self.checkpointer = ocp.StandardCheckpointer()
        self.orbax_dir = orbax_dir
        self.orbax_path = None
        self.step = 0
        #: each round's phases of a snapshot (SnapshotResult.phases) and of a restore
        #: (Restored.phases, and "ready")
        self.phases: dict[str, list[dict[str, float]]] = {
            "stage_stall": [], "stage_commit": [], "restore_local": []}
        # The stage job rotates through keep + 1 = 3 pooled segments: touch all before timing.
        for _ in range(3):
            self.stage_commit()

    def close(self) -> None:
        self.stager.close()
        self.restorer.close()
        self.checkpointer.close()

    def memcpy_warm(self) -> float:
        started, offset = time.perf_counter(), 0
        for shard in self.shards:
            np.copyto(self.warm[offset:offset + shard.nbytes], shard)
            offset += shard.nbytes
        return time.perf_counter() - started

    def memcpy_fresh(self) -> float:
        started = time.perf_counter()
        copies = []
        for shard in self.shards:
            copies.append(np.empty(shard.nbytes, np.uint8))
            np.copyto(copies[-1], shard)
        return time.perf_counter() - started

    def stage_stall(self) -> float:
        self.step += 1
        started = time.perf_counter()
        result = self.stager.snapshot(self.step, self.state, wait=False)
        elapsed = time.perf_counter() - started
        check_snapshot(result, f"snapshot of step {self.step}")
        check_snapshot(self.stager.wait(), f"commit of step {self.step}")
        self.phases["stage_stall"].append(result.phases)
        return elapsed

    def stage_commit(self) -> float:
        self.step += 1
        started = time.perf_counter()
        self.stager.snapshot(self.step, self.state, wait=False)
        result = self.stager.wait()
        elapsed = time.perf_counter() - started
        check_snapshot(result, f"commit of step {self.step}")
        self.phases["stage_commit"].append(result.phases)
        return elapsed

    def restore_local(self) -> float:
        import jax
        started = time.perf_counter()
        restored = self.restorer.restore(self.target)
        returned = time.perf_counter()
        jax.block_until_ready(restored.state)
        elapsed = time.perf_counter() - started
        self.phases["restore_local"].append({**restored.phases,
                                             "ready": elapsed - (returned - started)})
        return elapsed

    def orbax_save(self) -> float:
        path = tempfile.mkdtemp(dir=self.orbax_dir)
        os.rmdir(path)  # Orbax wants to create the directory itself
        started = time.perf_counter()
        self.checkpointer.save(path, self.state)
        self.checkpointer.wait_until_finished()
        elapsed = time.perf_counter() - started
        if self.orbax_path is not None:
            shutil.rmtree(self.orbax_path)
        self.orbax_path = path
        return elapsed

    def orbax_restore(self) -> float:
        import jax
        started = time.perf_counter()
        jax.block_until_ready(self.checkpointer.restore(self.orbax_path, self.target))
        return time.perf_counter() - started

    def restore_matches(self) -> bool:
        """Whether both jobs restore the state bit for bit, with the same shardings."""
        return all(common.same_state(self.state, client.restore(self.target).state)
                   for client in (self.stager, self.restorer))


def summarize(seconds: dict[str, list[float]], state_bytes: int, repeats: int,
              matches: bool, devices: int, phases: dict) -> dict:
    modes, med = common.bandwidths(seconds, lambda mode: state_bytes)
    ratios = {
        "staging_vs_memcpy_warm": med["stage_commit"] / med["memcpy_warm"],
        "stall_vs_memcpy_warm": med["stage_stall"] / med["memcpy_warm"],
        "restore_vs_memcpy_fresh": med["restore_local"] / med["memcpy_fresh"],
        "restore_vs_memcpy_warm": med["restore_local"] / med["memcpy_warm"],
        "restore_vs_orbax_restore": med["restore_local"] / med["orbax_restore"],
        "staging_vs_orbax_save": med["stage_commit"] / med["orbax_save"],
    }
    return {
        "benchmark": "datapath", "state_bytes": state_bytes, "devices": devices,
        "repeats": repeats, "modes": modes,
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "meets_targets": {
            "staging_ge_50pct_memcpy_warm": ratios["staging_vs_memcpy_warm"] >= 0.5,
            "restore_ge_50pct_memcpy_fresh": ratios["restore_vs_memcpy_fresh"] >= 0.5,
            "restore_ge_10x_orbax_restore": ratios["restore_vs_orbax_restore"] >= 10,
            # issue 13's goal (reported, never failed on)
            "staging_ge_80pct_memcpy_warm": ratios["staging_vs_memcpy_warm"] >= 0.8,
        },
        # the timed rounds' (the first is the warm-up's)
        "phases": common.phase_medians({m: r[1:] or r for m, r in phases.items()}),
        "restore_matches": matches,
    }


def print_datapath_table(report: dict) -> None:
    common.print_table(report, f"state: {report['state_bytes'] / 1e6:.0f} MB on "
                               f"{report['devices']} device(s), {report['repeats']} interleaved "
                               "rounds")
    print(f"restore matches the state bit for bit: {report['restore_matches']}")
    for mode, spent in report["phases"].items():
        print(f"{mode} phases (median ms): "
              + ", ".join(f"{name} {ms:.1f}" for name, ms in spent.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=256, help="state size (default 256)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--devices", type=int, default=1,
                        help="CPU devices to shard leaves over (sets "
                             "--xla_force_host_platform_device_count; default 1)")
    args = common.parse_args(parser, quick={"size_mb": 8, "repeats": 2})
    common.exit_on_sigterm()
    if args.devices > 1:
        common.force_cpu_devices(args.devices)
    state = common.make_state(int(args.size_mb * 1e6), args.devices)
    shards = common.shard_bytes(state)
    state_bytes = sum(s.nbytes for s in shards.values())
    common.log(f"state: {state_bytes / 1e6:.0f} MB in {len(shards)} shards")
    daemon = DaemonProcess("--memory-budget", str(max(4 << 30, 8 * state_bytes)))
    orbax_dir = tempfile.mkdtemp(dir="/dev/shm", prefix="bubblesnap-bench-orbax-")
    bench = None
    try:
        bench = Bench(state, daemon.address, orbax_dir)
        # the warm-up round runs in MODES order: orbax_save writes what orbax_restore reads
        seconds = common.measure(bench, MODES, args.repeats)
        report = summarize(seconds, state_bytes, args.repeats, bench.restore_matches(),
                           args.devices, bench.phases)
    finally:
        if bench is not None:
            bench.close()
        daemon.stop()
        shutil.rmtree(orbax_dir, ignore_errors=True)
    common.report_out(report, args.json, print_datapath_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
