"""Adoption: how long a daemon restarted on a killed one's --shm-dir takes to adopt what it held.

A daemon is filled with --gib of committed copies (--copy-mib each, one job,
--keep as many), SIGKILLed, and started again on the same --shm-dir, --rounds
times (each restart adopts what the previous one adopted). Adoption verifies
every byte against its xxh3 checksum before the daemon serves, so its physical
limit is hashing: xxh3 over the same bytes is measured in the same run, on one
thread and on the daemon's --checksum-threads (2) at once. Reported: adoption
seconds (the daemon's own measure, in Status) per round and per GiB, the
start-to-ready time of the restart next to a start on an empty directory,
and whether the newest step restores bit for bit after the last restart.

Usage: python benchmarks/adoption.py [--json] [--quick] [--gib 2] [--copy-mib 256] [--rounds 3]
"""

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import bench_common as common
import numpy as np

from bubblesnap.clients import ClientOptions, NumpyClient
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.protos.checksum import checksum
from bubblesnap.testing import DaemonProcess

_THREADS = 2  # the daemon's default --checksum-threads


def copy_of(step: int, nbytes: int) -> np.ndarray:
    return np.arange(nbytes // 4, dtype=np.uint32) + np.uint32(step)


def hash_seconds(copies: int, nbytes: int, threads: int) -> float:
    """Seconds to hash ``copies`` buffers of ``nbytes`` with ``threads`` threads."""
    buffers = [copy_of(step, nbytes) for step in range(min(copies, threads))]
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: checksum(buffers[i % len(buffers)]), range(copies)))
    return time.perf_counter() - started


def started(shm: str, *flags: str) -> tuple[DaemonProcess, float]:
    began = time.perf_counter()
    daemon = DaemonProcess("--shm-dir", shm, *flags, own_shm_dir=False, log_level="INFO",
                           stderr=None)
    return daemon, time.perf_counter() - began


def run(gib: float, copy_mib: int, rounds: int) -> dict:
    nbytes = copy_mib << 20
    copies = max(1, int(gib * (1 << 30)) // nbytes)
    flags = ("--memory-budget", str(2 * copies * nbytes), "--keep", str(copies))
    shm = tempfile.mkdtemp(dir="/dev/shm", prefix="bubblesnap-bench-adoption-")
    daemon = None
    try:
        empty = tempfile.mkdtemp(dir=shm, prefix="empty-")
        daemon, empty_start = started(empty, *flags)
        daemon.stop()
        held = tempfile.mkdtemp(dir=shm, prefix="held-")
        daemon, _ = started(held, *flags)
        client = NumpyClient("bench", options=ClientOptions(daemon=daemon.address))
        for step in range(copies):
            assert client.snapshot(step, {"x": copy_of(step, nbytes)}).committed, step
        client.close()
        common.log(f"holding {copies} copies of {copy_mib} MiB")
        seconds, restarts, adopted = [], [], 0
        for _ in range(rounds):
            daemon.kill()
            daemon, restart = started(held, *flags)
            adoption = daemon.stub.Status(pb.StatusRequest(), timeout=30).adoption
            adopted = adoption.adopted_bytes
            seconds.append(adoption.seconds)
            restarts.append(restart)
            common.log(f"adopted {len(adoption.adopted)} copies in {adoption.seconds:.3f} s")
        step, restored = NumpyClient("bench", options=ClientOptions(
            daemon=daemon.address)).restore()
        matches = step == copies - 1 and np.array_equal(restored["x"], copy_of(step, nbytes))
    finally:
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(shm, ignore_errors=True)
    hashing = {threads: hash_seconds(copies, nbytes, threads) for threads in (1, _THREADS)}
    gib_held = copies * nbytes / (1 << 30)
    median = statistics.median(seconds)
    return {
        "benchmark": "adoption", "copies": copies, "copy_bytes": nbytes,
        "adopted_bytes": adopted, "rounds": rounds,
        "adoption_seconds": {"median": median, "min": min(seconds), "max": max(seconds)},
        "adoption_seconds_per_gib": median / gib_held,
        "hash_seconds_per_gib": {f"{t}_threads": s / gib_held for t, s in hashing.items()},
        "adoption_vs_hash": median / hashing[_THREADS],
        "restart_seconds": statistics.median(restarts), "empty_start_seconds": empty_start,
        "restored_matches": bool(matches) and adopted == copies * nbytes,
    }


def print_table(report: dict) -> None:
    s = report["adoption_seconds"]
    print(f"adopted {report['adopted_bytes'] / 2**30:.2f} GiB ({report['copies']} copies) in "
          f"{s['median']:.3f} s median ({s['min']:.3f}-{s['max']:.3f}) over "
          f"{report['rounds']} restarts: {report['adoption_seconds_per_gib']:.3f} s/GiB")
    hashing = report["hash_seconds_per_gib"]
    print(f"xxh3 over the same bytes: {hashing['1_threads']:.3f} s/GiB on 1 thread, "
          f"{hashing[f'{_THREADS}_threads']:.3f} on {_THREADS}; adoption / hashing "
          f"{report['adoption_vs_hash']:.2f}")
    print(f"restart to ready {report['restart_seconds']:.2f} s, an empty start "
          f"{report['empty_start_seconds']:.2f} s; restored bit for bit: "
          f"{report['restored_matches']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2, help="bytes held (default 2 GiB)")
    parser.add_argument("--copy-mib", type=int, default=256, help="one copy (default 256 MiB)")
    parser.add_argument("--rounds", type=int, default=3, help="restarts timed (default 3)")
    args = common.parse_args(parser, quick={"gib": 0.03125, "copy_mib": 8, "rounds": 1})
    common.exit_on_sigterm()
    common.report_out(run(args.gib, args.copy_mib, args.rounds), args.json, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
