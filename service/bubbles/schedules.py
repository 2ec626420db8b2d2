"""Pure: a pipeline schedule simulated op by op, and the bubbles it leaves on each stage.

For the planner's tools (``bubblesnap plan``, benchmarks/plan_scale.py): a
profile of a job that does not run yet. An op starts when its stage is free
and its input is there (forward i of stage s after forward i of stage s-1;
backward i of stage s after backward i of stage s+1). Every gap in a
stage's timeline is a bubble: the warm-up wait before its first forward,
the waits between its ops, and the cool-down after its last backward until
the iteration ends. In 1F1B (PipeDream-flush) and GPipe alike each stage
idles (p-1)(f+b) per iteration.
"""

SCHEDULES = ("1f1b", "gpipe")


def op_orders(stages: int, microbatches: int, schedule: str):
    """Each stage's ops in the order it runs them: ("F" | "B", microbatch)."""
    orders = []
    for s in range(stages):
        if schedule == "gpipe":
            order = [("F", i) for i in range(microbatches)]
            order += [("B", i) for i in range(microbatches)]
        else:  # 1F1B: warm-up forwards, then one forward / one backward, then the rest
            warmup = min(stages - 1 - s, microbatches)
            order = [("F", i) for i in range(warmup)]
            for i in range(warmup, microbatches):
                order += [("F", i), ("B", i - warmup)]
            order += [("B", i) for i in range(microbatches - warmup, microbatches)]
        orders.append(order)
    return orders


def simulate(stages: int, microbatches: int, forward: float, backward: float, schedule: str):
    """Start and end of every op per stage, and the iteration's end.

    Sweeps the stages alternately up (forwards flow up) and down (backwards
    flow down), running on each stage every op whose input is ready.
    """
    orders = op_orders(stages, microbatches, schedule)
    ends = {"F": [[None] * microbatches for _ in range(stages)],
            "B": [[None] * microbatches for _ in range(stages)]}
    clock = [0.0] * stages
    done = [0] * stages
    timeline = [[] for _ in range(stages)]
    left, upward = sum(len(o) for o in orders), True
    while left:
        moved = False
        for s in (range(stages) if upward else range(stages - 1, -1, -1)):
            order = orders[s]
            while done[s] < len(order):
                kind, i = order[done[s]]
                if kind == "F":
                    ready = ends["F"][s - 1][i] if s > 0 else 0.0
                else:
                    ready = ends["B"][s + 1][i] if s < stages - 1 else ends["F"][s][i]
                if ready is None:
                    break
                start = max(clock[s], ready)
                clock[s] = ends[kind][s][i] = start + (forward if kind == "F" else backward)
                timeline[s].append((start, clock[s]))
                done[s] += 1
                left -= 1
                moved = True
        if not moved and not upward:
            raise RuntimeError("schedule deadlocked")
        upward = not upward
    return timeline, max(clock)


def bubbles_of(timeline, iteration: float, tolerance: float):
    """(position, seconds) of each idle gap: position k is the gap before op k."""
    gaps, previous = [], 0.0
    for k, (start, end) in enumerate([*timeline, (iteration, iteration)]):
        if start - previous > tolerance:
            gaps.append((k, start - previous))
        previous = end
    return tuple(gaps)
