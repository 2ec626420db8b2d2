"""A training loop written for Orbax's CheckpointManager, saving every step, with
bubblesnap's manager (the import swapped) and with Orbax's: step time and restore time.

Usage: python benchmarks/manager.py [--json] [--quick] [--size-mb 64] [--steps 8]
[--rounds 3]

The loop is a Flax ``TrainState`` (a Python-int step, Adam's moments, bf16-free
float32 parameters of about ``--size-mb``) updated by one jitted step per
iteration. Modes, interleaved round by round (bench_common.measure): ``none``
(no checkpointing); ``memcpy`` (the bound: one plain copy of the state's bytes
into a kept host buffer per step, what any snapshot must at least pay);
``bubblesnap`` (its manager, ``save`` every step, asynchronous: every step on disk,
written by the daemon from its memory while training goes on, a save waiting for
the previous step's write as Orbax's does); ``bubblesnap_memory`` (its manager
with ``memory_interval_steps=1``: every step into the daemon's memory, every tenth
also on disk); ``bubblesnap_memory_only`` (every step into memory, none on disk after
the first: the cost of the memory tier alone); ``orbax`` (Orbax's manager, ``save``
every step, asynchronous) and
``orbax_every_10`` (every tenth step, the cadence its cost makes users choose).
Every folder is on tmpfs, the fastest disk here. Each mode times ``--steps``
iterations after its manager saved once; it reports the median step time and the
overhead over ``none``. Then the restore of the latest step: bubblesnap's manager
from the daemon's memory against Orbax's from tmpfs, both into the state's
shardings, compared bit for bit.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common

from bubblesnap.testing import DaemonProcess

MODES = ["none", "memcpy", "bubblesnap", "bubblesnap_memory", "bubblesnap_memory_only",
         "orbax", "orbax_every_10"]


class Bench:
    """One process holding the state, a daemon's manager and Orbax's."""

    def __init__(self, size_bytes: int, steps: int, address: str, root: str):
        import jax
        import orbax.checkpoint as ocp

        from bubblesnap.clients.jax import (
            CheckpointManager,
            CheckpointManagerOptions,
            ClientOptions,
        )

        self._ocp, self._steps, self._root = ocp, steps, root
        # float32 parameters of a third of the size: with Adam's two moments, the size
        params = common.make_state(size_bytes * 10 // 12, 1)["mu"]
        self.state, self._train_step = common.adam_train_state(params)
        self.state = self._train_step(self.state)
        self.state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(self.state))
        self._buffer = np.empty(self.state_bytes, np.uint8)  # memcpy's, warm once used
        self.step = 0
        client = ClientOptions(daemon=address)
        self.managers = {
            "bubblesnap": CheckpointManager(os.path.join(root, "durable", "every"),
                                            options=CheckpointManagerOptions(
                                                max_to_keep=2, client=client)),
            "bubblesnap_memory": CheckpointManager(
                os.path.join(root, "durable", "memory"), options=CheckpointManagerOptions(
                    max_to_keep=2, save_interval_steps=10, memory_interval_steps=1,
                    client=client)),
            "bubblesnap_memory_only": CheckpointManager(
                os.path.join(root, "durable", "memory_only"), options=CheckpointManagerOptions(
                    max_to_keep=2, save_interval_steps=1 << 40, memory_interval_steps=1,
                    client=client)),
            "orbax": ocp.CheckpointManager(os.path.join(root, "orbax"),
                                           options=ocp.CheckpointManagerOptions(max_to_keep=2)),
            "orbax_every_10": ocp.CheckpointManager(
                os.path.join(root, "orbax10"), options=ocp.CheckpointManagerOptions(
                    max_to_keep=2, save_interval_steps=10)),
        }

    def _loop(self, manager, copy=None) -> float:
        """Seconds per step over the run's steps (the manager saved once before)."""
        import jax
        args = self._ocp.args
        if manager is not None:  # every mode starts from a step on disk, its write done
            self.step += 1
            manager.save(self.step, args=args.StandardSave(self.state), force=True)
            manager.wait_until_finished()
        started = time.perf_counter()
        for _ in range(self._steps):
            self.state = self._train_step(self.state)
            self.step += 1
            if manager is not None:
                manager.save(self.step, args=args.StandardSave(self.state))
            if copy is not None:
                copy(self.state)
        jax.block_until_ready(self.state)
        spent = (time.perf_counter() - started) / self._steps
        if manager is not None:
            manager.wait_until_finished()
        return spent

    def none(self) -> float:
        return self._loop(None)

    def memcpy(self) -> float:
        return self._loop(None, copy=self._copy)

    def _copy(self, state) -> None:
        """One plain copy of every array's bytes into the kept buffer."""
        import jax
        offset = 0
        for leaf in jax.tree.leaves(state):
            data = common.flat_bytes(jax.block_until_ready(leaf))
            np.copyto(self._buffer[offset:offset + data.nbytes], data)
            offset += data.nbytes

    def bubblesnap(self) -> float:
        return self._loop(self.managers["bubblesnap"])

    def bubblesnap_memory(self) -> float:
        return self._loop(self.managers["bubblesnap_memory"])

    def bubblesnap_memory_only(self) -> float:
        return self._loop(self.managers["bubblesnap_memory_only"])

    def orbax(self) -> float:
        return self._loop(self.managers["orbax"])

    def orbax_every_10(self) -> float:
        return self._loop(self.managers["orbax_every_10"])

    def restores(self, rounds: int) -> dict:
        """Median seconds of restoring each manager's latest step, and whether both gave
        the state back bit for bit."""
        import jax
        args = self._ocp.args
        target = jax.tree.map(self._ocp.utils.to_shape_dtype_struct, self.state)
        for name in ("bubblesnap", "orbax"):
            manager = self.managers[name]
            manager.save(self.step + 1, args=args.StandardSave(self.state), force=True)
            manager.wait_until_finished()
        self.step += 1
        seconds, matches = {"bubblesnap": [], "orbax": []}, {}
        for _ in range(rounds):
            for name in seconds:
                manager = self.managers[name]
                started = time.perf_counter()
                restored = jax.block_until_ready(
                    manager.restore(self.step, args=args.StandardRestore(target)))
                seconds[name].append(time.perf_counter() - started)
                matches[name] = bool(common.same_state(self.state.params, restored.params)
                                     and int(restored.step) == int(self.state.step))
        return {name: statistics.median(values) for name, values in seconds.items()}, matches

    def close(self) -> None:
        for manager in self.managers.values():
            manager.close()


def print_manager_table(report: dict) -> None:
    print(f"{report['state_mb']:.0f} MB state, {report['steps']} steps a round, "
          f"{report['rounds']} rounds (median step ms, overhead over none)")
    for mode, row in report["modes"].items():
        print(f"  {mode:15s} {row['median_step_ms']:8.2f} ms  {row['overhead']:+.1%}")
    print(f"restore latest: bubblesnap {report['restore']['bubblesnap_ms']:.1f} ms, orbax "
          f"{report['restore']['orbax_ms']:.1f} ms ({report['restore']['speedup']:.1f}x), "
          f"bit for bit: {report['restore_matches']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=64, help="state size (default 64)")
    parser.add_argument("--steps", type=int, default=8, help="steps a round (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    args = common.parse_args(parser, quick={"size_mb": 4, "steps": 2, "rounds": 1})
    common.exit_on_sigterm()
    root = tempfile.mkdtemp(dir="/dev/shm", prefix="bubblesnap-bench-manager-")
    daemon = DaemonProcess("--memory-budget", str(max(4 << 30, int(20 * args.size_mb * 1e6))),
                           "--durable-dir", os.path.join(root, "durable"), "--keep", "2")
    bench = None
    try:
        bench = Bench(int(args.size_mb * 1e6), args.steps, daemon.address, root)
        seconds = common.measure(bench, MODES, args.rounds)
        restore, matches = bench.restores(args.rounds)
        state_bytes = bench.state_bytes
    finally:
        if bench is not None:
            bench.close()
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    base = statistics.median(seconds["none"])
    report = {"benchmark": "manager", "state_mb": state_bytes / 1e6, "steps": args.steps,
              "rounds": args.rounds,
              "modes": {mode: {"median_step_ms": statistics.median(values) * 1e3,
                               "overhead": statistics.median(values) / base - 1}
                        for mode, values in seconds.items()},
              "vs_memcpy": {mode: statistics.median(seconds[mode]) /
                            statistics.median(seconds["memcpy"])
                            for mode in ("bubblesnap", "bubblesnap_memory",
                                         "bubblesnap_memory_only")},
              "restore": {"bubblesnap_ms": restore["bubblesnap"] * 1e3,
                          "orbax_ms": restore["orbax"] * 1e3,
                          "speedup": restore["orbax"] / restore["bubblesnap"]},
              "restore_matches": matches}
    common.report_out(report, args.json, print_manager_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
