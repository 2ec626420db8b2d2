"""Runs benchmark modes interleaved, round after round, so a noisy machine hits them alike.

The first mode rotates every round; one untimed warm-up round comes first.
Before each mode the process hands its free heap back to the OS (glibc
malloc_trim), so one mode's garbage does not make the next one's memory warm.
"""

import ctypes

_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only


def measure(bench, modes, rounds: int, log) -> dict[str, list[float]]:
    """Seconds per mode (``bench.<mode>()`` returns the seconds it timed) over ``rounds``
    rounds, after a warm-up round in ``modes`` order; ``log`` gets a line per round."""
    seconds = {mode: [] for mode in modes}
    for round_ in range(rounds + 1):
        order = modes[round_ % len(modes):] + modes[:round_ % len(modes)]
        timings = {}
        for mode in order:
            if _MALLOC_TRIM is not None:
                _MALLOC_TRIM(0)
            timings[mode] = getattr(bench, mode)()
        label = "warm-up" if round_ == 0 else f"round {round_}/{rounds}"
        log(f"{label}: " + " ".join(f"{m}={t * 1e3:.0f}ms" for m, t in timings.items()))
        if round_:
            for mode, t in timings.items():
                seconds[mode].append(t)
    return seconds
