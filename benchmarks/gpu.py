"""The accelerator run: device<->host copies against the link, and snapshot overhead.

Written for the day a CUDA host is lent (benchmarks/gpu.sh runs it there in
under 8 minutes); it runs the same on the CPU backend (--device cpu, the
tests' --quick), with CPU numbers, so it cannot rot. One state pytree
(default 1 GB: bfloat16 params with float32 Adam moments, 12 leaves, as in
restore.py) lives on the devices (rows sharded over every local device of
the platform), and a daemon (bubblesnap.testing) holds its snapshots. Modes,
each in GB/s (1e9 bytes/s) of the state's bytes:

  pinned_d2h     jax.device_put of the state into pinned host memory (the same
                 sharding, memory kind "pinned_host"): DMA into page-locked memory,
                 the link's device-to-host limit
  orbax_fetch    the JAX client's fetch, clients/jax/_transfer.fetch_to_host:
                 Orbax's transfer_arrays_to_host (pinned, every copy started before
                 any is waited on) into host numpy arrays. On the CPU backend it
                 returns views of the device buffers (no copy): there it times the
                 bookkeeping alone
  snapshot       SnapshotClient.snapshot(step, state, wait=True): the fetch, the copy
                 into the daemon's shared memory, the commit (checksums)
  pinned_h2d     jax.device_put of a pinned-host copy of the state onto the devices:
                 the link's host-to-device limit
  restore_local  SnapshotClient.restore of the snapshot from the daemon's memory
                 onto the devices (map, verify, one host-to-device transfer per shard)

Modes run interleaved round after round (bench_common.measure); every fetch,
snapshot and restore is compared bit for bit with the state outside the
clock. Ratios: orbax_fetch_vs_pinned_d2h and snapshot_vs_pinned_d2h (what
the fetch path and a whole snapshot get of the link), restore_local_vs_
pinned_h2d (a restore to the device against the link).

Then the overhead of a snapshot every iteration in the pipeline example:
examples/pipeline_gpt.py, one process per stage (--transport processes; on
an accelerator every stage process shares the host's devices, memory not
preallocated), modes none, bubblesnap (--max-interval 1: step k fetched in
iteration k+1's bubbles, every iteration) and eager, interleaved in segments
by the example; its report is carried under "pipeline" with, per mode, the
median step time, the snapshots taken and overhead_pct against none.

JSON: device (platform, kind, count), state_bytes, rounds, modes (per mode
median_gbps, min_gbps, max_gbps, median_ms), ratios, matches (per mode: bit
for bit), pipeline (the example's modes and per_stage), seconds (the whole
run). On a GPU host: benchmarks/gpu.sh (checks nvidia-smi, a time limit).

Usage: python benchmarks/gpu.py [--json] [--quick] [--device auto|gpu|cpu] [--mb 1024]
       [--rounds 5] [--pipeline-rounds 3]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import bench_common as common
import numpy as np

from bubblesnap.protos.checksum import checksum

MODES = ("pinned_d2h", "orbax_fetch", "snapshot", "pinned_h2d", "restore_local")
JOB = "bench-gpu"
_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "examples", "pipeline_gpt.py")


def platform_of(device: str) -> str:
    """The JAX platform --device asks for; sets JAX_PLATFORMS before JAX is imported
    (auto: an accelerator where one is visible, else the CPU)."""
    if device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        return "cpu"
    if device == "gpu":
        os.environ["JAX_PLATFORMS"] = "cuda"
        return "gpu"
    import jax
    return jax.devices()[0].platform


class Bench:
    """The state, its pinned host copy, a daemon and client; one timing function per mode."""

    def __init__(self, state, daemon):
        import jax

        from bubblesnap.clients.jax import ClientOptions, SnapshotClient
        self.state = state
        self.target = common.restore_target(state)
        self.shardings = jax.tree.map(lambda x: x.sharding, state)
        self.pinned = jax.tree.map(lambda x: x.sharding.with_memory_kind("pinned_host"), state)
        # The host-to-device mode's source: a pinned copy made once, outside the clock.
        self.host_copy = jax.block_until_ready(jax.device_put(state, self.pinned))
        # A measured snapshot must complete: a trainer's 5 s give-up (rpc_timeout_seconds)
        # is the product's, and a quick run beside every other benchmark can pass it.
        self.client = SnapshotClient(JOB, options=ClientOptions(daemon=daemon.address,
                                                                rpc_timeout_seconds=120,
                                                                restore_timeout_seconds=300))
        self.matches = dict.fromkeys(MODES, True)
        self.problems: list[str] = []
        self.step = 0

    def close(self) -> None:
        self.client.close()

    def _same(self, mode: str, got) -> None:
        if not common.same_state(self.state, got):
            self.matches[mode] = False
            self.problems.append(f"{mode}: the bytes differ from the state")

    def pinned_d2h(self) -> float:
        import jax
        started = time.perf_counter()
        copied = jax.block_until_ready(jax.device_put(self.state, self.pinned))
        elapsed = time.perf_counter() - started
        if not all(np.array_equal(common.flat_bytes(a), common.flat_bytes(b))
                   for a, b in zip(jax.tree.leaves(self.state), jax.tree.leaves(copied),
                                   strict=True)):
            self.matches["pinned_d2h"] = False
            self.problems.append("pinned_d2h: the pinned copy differs from the state")
        return elapsed

    def orbax_fetch(self) -> float:
        import jax

        from bubblesnap.clients.jax import _transfer
        leaves = jax.tree.leaves(self.state)
        started = time.perf_counter()
        host = _transfer.fetch_to_host(leaves)
        host = [np.asarray(h) for h in host]  # every copy landed
        elapsed = time.perf_counter() - started
        # Orbax's order of the shards is its own: each fetched one is matched by its bytes
        expected: dict[int, list] = {}
        for leaf in leaves:
            for shard in leaf.addressable_shards:
                if shard.replica_id == 0:
                    data = common.flat_bytes(shard.data)
                    expected.setdefault(checksum(data), []).append(data)
        found = [(checksum(h), h.reshape(-1).view(np.uint8)) for h in host]
        if len(found) != sum(map(len, expected.values())) or not all(
                any(np.array_equal(h, e) for e in expected.get(digest, ()))
                for digest, h in found):
            self.matches["orbax_fetch"] = False
            self.problems.append("orbax_fetch: the host bytes differ from the state")
        return elapsed

    def snapshot(self) -> float:
        self.step += 1
        started = time.perf_counter()
        result = self.client.snapshot(self.step, self.state, wait=True)
        elapsed = time.perf_counter() - started
        if result is None or not result.taken:
            self.matches["snapshot"] = False
            self.problems.append(f"snapshot: not taken: {getattr(result, 'reason', '')}")
        return elapsed

    def pinned_h2d(self) -> float:
        import jax
        started = time.perf_counter()
        placed = jax.block_until_ready(jax.device_put(self.host_copy, self.shardings))
        elapsed = time.perf_counter() - started
        self._same("pinned_h2d", placed)
        return elapsed

    def restore_local(self) -> float:
        import jax
        if self.step == 0:  # the first round may run before any snapshot
            self.snapshot()
        started = time.perf_counter()
        restored = self.client.restore(self.target)
        jax.block_until_ready(restored.state)
        elapsed = time.perf_counter() - started
        if restored.source != "memory":
            self.problems.append(f"restore_local: restored from {restored.source!r}")
        self._same("restore_local", restored.state)
        return elapsed


def pipeline_overhead(platform: str, args) -> dict:
    """examples/pipeline_gpt.py with a snapshot every iteration, next to none and eager."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cuda" if platform == "gpu" else "cpu"
    if platform == "gpu":  # every stage process shares the devices: none takes them all
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    command = [sys.executable, _EXAMPLE, "--transport", "processes", "--stages", "2",
               "--modes", "none,bubblesnap,eager", "--max-interval", "1",
               "--rounds", str(args.pipeline_rounds), "--segment", str(args.segment),
               "--segment-warmup", "2", "--warmup", "4", "--json"]
    if args.quick:
        command += ["--d-model", "64", "--vocab", "256", "--seq-len", "16"]
    common.log("running " + " ".join(command[1:]))
    done = subprocess.run(command, env=env, capture_output=True, text=True,
                          timeout=args.pipeline_timeout)
    if done.returncode != 0:
        raise RuntimeError(f"pipeline_gpt.py exited with {done.returncode}: "
                           f"{done.stderr[-3000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    keep = ("median_step_seconds", "min_step_seconds", "max_step_seconds", "measured_steps",
            "snapshots", "snapshot_interval", "overhead_pct")
    return {"modes": {mode: {k: row.get(k) for k in keep}
                      for mode, row in report["modes"].items()},
            "per_stage": [{k: s.get(k) for k in ("stage", "state_bytes",
                                                 "bubble_seconds_per_iteration",
                                                 "naive_copy_seconds")}
                          for s in report["per_stage"]]}


def print_gpu_table(report: dict) -> None:
    device = report["device"]
    common.print_table(report, f"{report['state_bytes'] / 1e6:.0f} MB on {device['count']} "
                               f"{device['platform']} device(s) ({device['kind']}), "
                               f"{report['rounds']} interleaved rounds", report["matches"])
    for mode, row in report["pipeline"]["modes"].items():
        print(f"pipeline {mode}: median step {row['median_step_seconds'] * 1e3:.1f} ms, "
              f"{row['snapshots']} snapshots, overhead {row['overhead_pct']:+.1f}%")
    for problem in report["problems"]:
        print(f"problem: {problem}")


def main() -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto",
                        help="the JAX platform to measure (auto: an accelerator if visible)")
    parser.add_argument("--mb", type=float, default=1024, help="state size in MB (default 1024)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--pipeline-rounds", type=int, default=3,
                        help="the pipeline example's rounds over its modes (default 3)")
    parser.add_argument("--segment", type=int, default=5,
                        help="the example's measured iterations per mode and round (default 5)")
    parser.add_argument("--pipeline-timeout", type=float, default=300,
                        help="seconds the pipeline example may take (default 300)")
    args = common.parse_args(parser, quick={"mb": 8, "rounds": 1, "device": "cpu",
                                            "pipeline_rounds": 1, "segment": 2})
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    common.exit_on_sigterm()
    platform = platform_of(args.device)
    import jax

    from bubblesnap.testing import DaemonProcess
    devices = jax.local_devices()
    state = common.make_state(int(args.mb * 1e6), len(devices))
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    common.log(f"state: {state_bytes / 1e6:.0f} MB on {len(devices)} {platform} device(s)")
    # Room for the snapshots of every round (the oldest go: --keep 2) and a restore's.
    budget = 4 * state_bytes + (256 << 20)
    with tempfile.TemporaryDirectory(prefix="bubblesnap-bench-gpu-logs-") as logs, \
            DaemonProcess("--memory-budget", str(budget), "--keep", "2",
                          "--warm-pool-bytes", str(state_bytes + (4 << 20)),
                          stderr=os.path.join(logs, "daemon.log"), name="daemon") as daemon:
        bench = Bench(state, daemon)
        try:
            seconds = common.measure(bench, MODES, args.rounds)
        finally:
            bench.close()
            if bench.problems:  # what the daemon said of them, before its log goes
                with open(os.path.join(logs, "daemon.log"), errors="replace") as log:
                    common.log("daemon log, last lines:\n" + "".join(log.readlines()[-30:]))
    modes, med = common.bandwidths(seconds, lambda mode: state_bytes)
    pipeline = pipeline_overhead(platform, args)
    report = {
        "benchmark": "gpu",
        "device": {"platform": platform, "kind": devices[0].device_kind, "count": len(devices)},
        "state_bytes": state_bytes, "rounds": args.rounds, "modes": modes,
        "ratios": {
            "orbax_fetch_vs_pinned_d2h": round(med["orbax_fetch"] / med["pinned_d2h"], 3),
            "snapshot_vs_pinned_d2h": round(med["snapshot"] / med["pinned_d2h"], 3),
            "restore_local_vs_pinned_h2d": round(med["restore_local"] / med["pinned_h2d"], 3)},
        "matches": bench.matches, "problems": bench.problems, "pipeline": pipeline,
        "seconds": round(time.monotonic() - started, 1)}
    common.report_out(report, args.json, print_gpu_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
