"""What the benchmarks share: their flags, the test state, interleaved rounds, the report.

Every benchmark takes ``--json`` (the report as one JSON object on the last
line of stdout) and ``--quick`` (a tiny run, seconds long, that shows the
benchmark still works; its numbers mean nothing), and logs its progress on
stderr. JAX is imported only by the functions that need it, so a benchmark
can force its CPU device count first.
"""

import argparse
import ctypes
import gc
import json
import os
import re
import signal
import statistics
import sys

import numpy as np

_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only
# Leaf sizes of make_state as fractions of the parameter count.
_FRACTIONS = (0.5, 0.3, 0.15, 0.05)
_COLUMNS = 1024
#: Leaves in a make_state state: params, mu and nu of each size.
STATE_LEAVES = 3 * len(_FRACTIONS)


def log(message: str) -> None:
    """A progress line on stderr (stdout carries the report)."""
    print(message, file=sys.stderr, flush=True)


def parse_args(parser: argparse.ArgumentParser, quick: dict, argv=None) -> argparse.Namespace:
    """Adds ``--json`` and ``--quick`` to ``parser`` and parses ``argv``.

    ``quick`` maps option names (dests) to the values ``--quick`` uses
    instead of the defaults; options given on the command line still win.
    """
    argv = sys.argv[1:] if argv is None else argv
    flags = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in quick.items())
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--quick", action="store_true",
                        help=f"a tiny run to check the benchmark works, not to measure ({flags})")
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--quick", action="store_true")
    if probe.parse_known_args(argv)[0].quick:
        parser.set_defaults(**quick)
    return parser.parse_args(argv)


def exit_on_sigterm() -> None:
    """Makes SIGTERM end the run through its ``finally`` blocks, which stop its daemons
    (by default SIGTERM ends Python at once and the daemons outlive it)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def report_out(report: dict, as_json: bool, print_table) -> None:
    """Prints ``report``: as one JSON line, or as ``print_table(report)`` draws it."""
    if as_json:
        print(json.dumps(report), flush=True)
    else:
        print_table(report)


def proc_bytes(pid: int | str, field: str) -> int:
    """A size from /proc/<pid>/status (VmHWM, VmRSS, RssAnon, ...), in bytes (0 when gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


#: What the kernel does with memory, as machine_memory reports it: (name, file).
_MEMORY_SETTINGS = (
    ("thp_enabled", "/sys/kernel/mm/transparent_hugepage/enabled"),
    ("thp_defrag", "/sys/kernel/mm/transparent_hugepage/defrag"),
    ("thp_shmem_enabled", "/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
    ("page_reporting_order", "/sys/module/page_reporting/parameters/page_reporting_order"),
)


def machine_memory() -> dict[str, str | None]:
    """The kernel's memory settings that move every number here that touches fresh memory
    (None: not on this kernel). ``page_reporting_order`` is set in a VM whose balloon
    device takes back free memory: every freed block of 2^order pages goes back to the
    host, and touching it again costs a fault in the host too. On the dev VM (order 9)
    numpy filled fresh huge pages (its default for large arrays) at 0.3 GiB/s, 9 GiB/s
    with reporting off (docs/development/benchmarks.md, "This VM's memory")."""
    found = {}
    for name, path in _MEMORY_SETTINGS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            found[name] = None
            continue
        chosen = re.search(r"\[(\w[\w+]*)\]", text)  # "always [madvise] never"
        found[name] = chosen[1] if chosen else text
    return found


def force_cpu_devices(count: int) -> None:
    """Makes the JAX CPU backend show ``count`` devices; call before JAX is imported."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_"
                               f"platform_device_count={count}").strip()


def make_state(size_bytes: int, devices: int):
    """A training state of about ``size_bytes``: bf16 params + f32 Adam mu/nu (10 bytes
    per parameter) in leaves of 4 sizes, rows sharded over the first ``devices`` devices."""
    import jax
    import ml_dtypes
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    rng = np.random.default_rng(0)
    params = size_bytes / 10
    state = {"params": {}, "mu": {}, "nu": {}}
    for i, fraction in enumerate(_FRACTIONS):
        rows = max(devices, int(params * fraction / _COLUMNS) // devices * devices)
        values = rng.standard_normal((rows, _COLUMNS), dtype=np.float32)
        state["params"][f"w{i}"] = jax.device_put(values.astype(ml_dtypes.bfloat16), sharding)
        state["mu"][f"w{i}"] = jax.device_put(values * 0.1, sharding)
        state["nu"][f"w{i}"] = jax.device_put(values * values, sharding)
    return state


def adam_train_state(params):
    """A Flax ``TrainState`` of ``params`` with optax Adam (its two moments: three times
    the parameters' bytes), and a jitted training step applying a fixed gradient."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax.training import train_state

    @jax.jit
    def train_step(state):
        grads = jax.tree.map(lambda p: jnp.sin(p) * 1e-3, state.params)
        return state.apply_gradients(grads=grads)
    return train_state.TrainState.create(apply_fn=None, params=params,
                                         tx=optax.adam(1e-4)), train_step


def restore_target(state):
    """The abstract state a restore fills: each leaf's shape, dtype and sharding."""
    import jax
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def flat_bytes(array) -> np.ndarray:
    """The bytes of a host array (or a CPU shard) as a flat uint8 view, zero-copy."""
    return np.asarray(array).reshape(-1).view(np.uint8)


def shard_bytes(state) -> dict[tuple[str, tuple], np.ndarray]:
    """(tensor name as the clients name it, ((start, stop), ...)) -> the shard's bytes,
    each distinct shard once."""
    import jax
    found = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = "/".join(str(k.key) for k in path)
        for shard in leaf.addressable_shards:
            index = tuple(s.indices(d)[:2] for s, d in zip(shard.index, leaf.shape, strict=True))
            found.setdefault((name, index), flat_bytes(shard.data))
    return found


def same_state(expected, got) -> bool:
    """Same tree, shapes, dtypes, shardings, and every device's shard equal bit for bit."""
    import jax
    if jax.tree_util.tree_structure(expected) != jax.tree_util.tree_structure(got):
        return False
    for a, b in zip(jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(got),
                    strict=True):
        if a.shape != b.shape or a.dtype != b.dtype or a.sharding != b.sharding:
            return False
        theirs = {s.device: s for s in b.addressable_shards}
        for shard in a.addressable_shards:
            other = theirs.get(shard.device)
            if other is None or other.index != shard.index or not np.array_equal(
                    flat_bytes(shard.data), flat_bytes(other.data)):
                return False
    return True


def trim_memory() -> None:
    """Collects this process's garbage and hands its free heap back to the OS (glibc
    malloc_trim): a restore's arrays in a reference cycle keep the pages they map until
    the collector runs, and freed heap stays in the process's RSS until trimmed."""
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def measure(bench, modes, rounds: int) -> dict[str, list[float]]:
    """Seconds per mode over ``rounds`` rounds of every mode, interleaved.

    ``bench.<mode>()`` runs the mode once and returns the seconds it timed.
    Rounds run one after another so a noisy machine hits every mode alike;
    the first mode rotates every round, after one untimed warm-up round in
    ``modes`` order. Before each mode the process collects its garbage (a
    restore's arrays may sit in a reference cycle: freed by the collector at
    any later allocation, their mapping's pages with them, inside another
    mode's clock) and hands its free heap back to the OS (glibc malloc_trim),
    so one mode's garbage neither costs the next one time nor makes its
    memory warm.
    """
    seconds = {mode: [] for mode in modes}
    for round_ in range(rounds + 1):
        order = modes[round_ % len(modes):] + modes[:round_ % len(modes)]
        timings = {}
        for mode in order:
            trim_memory()
            timings[mode] = getattr(bench, mode)()
        label = "warm-up" if round_ == 0 else f"round {round_}/{rounds}"
        log(f"{label}: " + " ".join(f"{m}={t * 1e3:.0f}ms" for m, t in timings.items()))
        if round_:
            for mode, t in timings.items():
                seconds[mode].append(t)
    return seconds


def bandwidths(seconds: dict[str, list[float]], nbytes) -> tuple[dict, dict[str, float]]:
    """Per mode: median, min and max GB/s (1e9 bytes/s) and the median ms, rounded for the
    report; and the unrounded median GB/s for ratios. ``nbytes(mode)`` is what it moved."""
    modes, medians = {}, {}
    for mode, times in seconds.items():
        gbps = sorted(nbytes(mode) / t / 1e9 for t in times)
        medians[mode] = statistics.median(gbps)
        modes[mode] = {"median_gbps": round(medians[mode], 3), "min_gbps": round(gbps[0], 3),
                       "max_gbps": round(gbps[-1], 3),
                       "median_ms": round(statistics.median(times) * 1e3, 1)}
    return modes, medians


def phase_medians(recorded: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per mode, the median ms of each phase its rounds reported (a restore's
    ``phases``), in the order the phases first ran; a phase missing from a round
    counts as 0 there."""
    out = {}
    for mode, rounds in recorded.items():
        names = list(dict.fromkeys(name for r in rounds for name in r))
        out[mode] = {name: round(statistics.median(r.get(name, 0.0) for r in rounds) * 1e3, 2)
                     for name in names}
    return out


def print_table(report: dict, title: str, matches: dict[str, bool] | None = None) -> None:
    """The bandwidth table of ``report["modes"]`` (with a matches column when given), then
    its ratios and whether it meets its targets."""
    print(title)
    width = max(17, *(len(mode) + 1 for mode in report["modes"]))
    print(f"{'mode':<{width}}{'median GB/s':>12}{'min':>9}{'max':>9}{'median ms':>11}"
          + ("  matches" if matches else ""))
    for mode, row in report["modes"].items():
        print(f"{mode:<{width}}{row['median_gbps']:>12.2f}{row['min_gbps']:>9.2f}"
              f"{row['max_gbps']:>9.2f}{row['median_ms']:>11.1f}"
              + (f"  {matches[mode]}" if matches else ""))
    for name, value in report["ratios"].items():
        print(f"{name:<32}{value:>8.2f}")
    for name, met in report["meets_targets"].items():
        print(f"{name:<36}{'yes' if met else 'NO'}")
