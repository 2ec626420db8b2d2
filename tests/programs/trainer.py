"""A stand-in training process for the crash tests.

Its state at step k is a deterministic function of k (see ``state_at``), so a
restored state can be checked against the step it claims to be. With
``--pause-step`` it stops forever at a chosen point of that step's snapshot,
announcing it on stdout, so the test can SIGKILL it exactly there.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bubblesnap.clients.jax import ClientOptions, SnapshotClient, _transfer

PAUSE_POINTS = ("after_begin", "mid_copy", "before_commit")


def shardings():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    return {"w": NamedSharding(mesh, P("a", "b")), "m": NamedSharding(mesh, P("a")),
            "v": NamedSharding(mesh, P()), "count": NamedSharding(mesh, P())}


def state_at(step: int, rows: int):
    """Every value depends on the step, so a torn copy shows up as a mix of steps."""
    base = (np.arange(rows * 256) % 251).reshape(rows, 256)
    host = {"w": (base + step).astype(np.float32), "m": (base - step).astype(jnp.bfloat16),
            "v": (base * 2 + step).astype(np.int32), "count": np.array(step, np.int32)}
    return {k: jax.device_put(v, shardings()[k]) for k, v in host.items()}


def abstract(rows: int):
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
            for k, v in state_at(0, rows).items()}


def say(**event):
    print(json.dumps(event), flush=True)


def pause_fetch(pause_step: int, point: str, step_of):
    real = _transfer.fetch_to_host

    def fetch(leaves):
        host = real(leaves)
        if step_of() != pause_step:
            return host
        stop_at = {"after_begin": 0, "mid_copy": len(host) // 2, "before_commit": len(host)}[point]

        def pause():
            say(event="paused", step=pause_step, at=point)
            while True:
                time.sleep(60)

        def slow():
            for i, array in enumerate(host):
                if i == stop_at:
                    pause()
                yield array
            pause()  # before_commit: zip(strict=True) asks for one more item after the copies

        return slow()
    _transfer.fetch_to_host = fetch


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--daemon", required=True)
    parser.add_argument("--job", default="crash")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=64, help="state size: rows x 256 per tensor")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--pause-step", type=int, default=-1)
    parser.add_argument("--pause-at", choices=PAUSE_POINTS, default="mid_copy")
    args = parser.parse_args()

    client = SnapshotClient(args.job, options=ClientOptions(daemon=args.daemon))
    start = 0
    if args.resume:
        restored = client.restore(abstract(args.rows))
        expected = state_at(restored.step, args.rows)
        same = all(np.asarray(restored.state[k]).tobytes() == np.asarray(expected[k]).tobytes()
                   for k in expected)
        say(event="restored", step=restored.step, matches=same)
        start = restored.step + 1
    current = [start]
    if args.pause_step >= 0:
        pause_fetch(args.pause_step, args.pause_at, lambda: current[0])
    for step in range(start, args.steps):
        current[0] = step
        result = client.snapshot(step, state_at(step, args.rows), wait=True)
        say(event="snapshot", step=step, taken=result.taken, committed=result.committed,
            reason=result.reason)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
