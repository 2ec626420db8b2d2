"""A stand-in training process without JAX, for the kill matrix (tests/test_kill_matrix.py).

It starts in a fraction of a second, so dozens of kills fit in a test. Its
state at step k is a deterministic function of (k, rank) in which every
tensor names its step (see ``state_at`` and ``steps_of``): a restored state
shows which step each tensor came from, so a torn tensor (of no step) or a
mixed state (tensors of several steps) cannot pass for a good one. It prints
one JSON line per event: ``{"event": "restored", "step": k}`` after
``--resume``, and ``{"event": "snapshot", "step": k, "committed": bool}``
for every snapshot the daemon answered (``committed``: the job committed it,
as the client reports it with ``--wait``).
"""

import argparse
import json
import sys
import time

import numpy as np

from bubblesnap.clients import ClientOptions, NumpyClient

#: An offset per tensor, so equal-looking tensors of two steps never coincide.
_OFFSETS = {"count": 0, "m": 1 << 20, "w": 1 << 21}


def state_at(step: int, rank: int, rows: int) -> dict[str, np.ndarray]:
    """Rank ``rank``'s state at ``step``: every element depends on the step."""
    index = np.arange(rows * 256, dtype=np.int64).reshape(rows, 256)
    return {"w": ((index % 4093) + step + _OFFSETS["w"]).astype(np.float32),
            "m": (index[:, :64] * 3 + step * 5 + rank + _OFFSETS["m"]).astype(np.int32),
            "count": np.array([step, rank], np.int64)}


def steps_of(arrays: dict[str, np.ndarray], rank: int, rows: int) -> dict[str, int | None]:
    """Which step each tensor of a restored state is, bit for bit (None: of no step)."""
    first = {"w": lambda a: int(a.flat[0]) - _OFFSETS["w"],
             "m": lambda a: (int(a.flat[0]) - rank - _OFFSETS["m"]) // 5,
             "count": lambda a: int(a.flat[0])}
    found = {}
    for name, array in arrays.items():
        step = first[name](array)
        expected = state_at(step, rank, rows)[name] if step >= 0 else None
        same = expected is not None and array.dtype == expected.dtype and \
            array.tobytes() == expected.tobytes()
        found[name] = step if same else None
    return found


def say(**event) -> None:
    print(json.dumps(event), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--daemon", required=True)
    parser.add_argument("--job", default="kill")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--rows", type=int, default=256, help="state size: rows x 320 elements")
    parser.add_argument("--steps", type=int, default=1 << 30)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--wait", choices=("rank", "job"), default="rank")
    parser.add_argument("--backoff", type=float, default=0.1,
                        help="seconds without snapshots after the daemon did not answer")
    parser.add_argument("--commit-timeout", type=float, default=2.0)
    args = parser.parse_args()

    options = ClientOptions(daemon=args.daemon, backoff_seconds=args.backoff,
                            commit_timeout_seconds=args.commit_timeout)
    client = NumpyClient(args.job, args.rank, args.world_size, options)
    start = 0
    if args.resume:
        step, arrays = client.restore()
        if set(steps_of(arrays, args.rank, args.rows).values()) != {step}:
            say(event="restored", step=step, torn=True)
            return 1
        say(event="restored", step=step)
        start = step + 1
    for step in range(start, args.steps):
        result = client.snapshot(step, state_at(step, args.rank, args.rows), wait=args.wait)
        if result.taken:
            say(event="snapshot", step=step, committed=bool(result.committed))
        else:
            time.sleep(0.005)  # the daemon is down or refused: train on, a little slower
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
