"""The warm pool (--warm-pool-bytes): pre-faulted segments a daemon keeps ready, inside its
memory budget, taken by what lands in the daemon (a snapshot, a peer's copy for a restore)."""

import os

import numpy as np

from bubblesnap.clients import ClientOptions, NumpyClient
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.service.store.warm_pool import next_size
from bubblesnap.testing import wait_for

MIB = 1 << 20


def memory(daemon) -> pb.MemoryStatus:
    return daemon.stub.Status(pb.StatusRequest(), timeout=10).memory


def filled(daemon, nbytes: int):
    return lambda: memory(daemon).warm_bytes == nbytes


def test_the_pool_fills_to_its_size_in_the_budget_and_a_snapshot_takes_from_it(start_daemon):
    daemon = start_daemon("--memory-budget", "64MiB", "--warm-pool-bytes", "4MiB")
    wait_for(filled(daemon, 4 * MIB), "the warm pool filled")
    held = memory(daemon)
    assert held.warm_pool_bytes == 4 * MIB and held.warm_segments_taken == 0
    assert held.pooled_bytes == 4 * MIB and held.used_bytes == 0  # counted as pooled
    # the pages are allocated in the shm dir, not merely promised
    assert sum(e.stat().st_blocks * 512 for e in os.scandir(daemon.ready["shm_dir"])
               if e.name.startswith("seg-")) == 4 * MIB

    client = NumpyClient("warm", options=ClientOptions(daemon=daemon.address))
    state = {"x": np.arange(1 << 18, dtype=np.float32)}  # 1 MiB: the first segment asked
    assert client.snapshot(0, state).committed
    after = memory(daemon)
    assert after.warm_segments_taken == 1
    assert after.used_bytes + after.pooled_bytes <= after.budget_bytes
    step, restored = client.restore()
    assert step == 0 and restored["x"].tobytes() == state["x"].tobytes()
    # refilled in the size asked, up to the pool's size
    wait_for(lambda: 3 * MIB <= memory(daemon).warm_bytes <= 4 * MIB, "the pool refilled")
    client.close()


def thread_niceness(pid: int) -> list[int]:
    """The niceness of every thread of process ``pid`` (field 19 of its tasks' stat)."""
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            found.append(int(f.read().rsplit(")", 1)[1].split()[16]))
    return found


def test_every_thread_of_the_daemon_runs_at_its_niceness_the_pools_too(start_daemon):
    # A thread niced below the rest of the daemon holds the GIL and the store's lock
    # while a loaded host keeps it off the cores: every other thread waits on it. One
    # started before the daemon lowered its priority (by an import) would keep the old.
    daemon = start_daemon("--memory-budget", "64MiB", "--warm-pool-bytes", "4MiB",
                          "--nice", "5")
    wait_for(filled(daemon, 4 * MIB), "the warm pool filled")
    assert set(thread_niceness(daemon.proc.pid)) == {min(os.nice(0) + 5, 19)}


def test_a_pool_larger_than_the_budget_leaves_room_for_snapshots(start_daemon):
    daemon = start_daemon("--memory-budget", "3MiB", "--warm-pool-bytes", "16MiB",
                          "--keep", "1")
    wait_for(filled(daemon, 3 * MIB), "the warm pool filled what the budget holds")
    client = NumpyClient("tight", options=ClientOptions(daemon=daemon.address))
    for step in range(4):  # each needs room the warm pool has taken: trimmed for it
        result = client.snapshot(step, {"x": np.full(1 << 18, step, np.float32)})
        assert result.committed, result.reason
        held = memory(daemon)
        assert held.used_bytes + held.pooled_bytes <= held.budget_bytes
    step, restored = client.restore()
    assert step == 3 and (restored["x"] == 3).all()
    client.close()


def test_a_replacement_host_restores_a_peers_copy_into_a_warm_segment(start_ring):
    ring = start_ring(3, "--replicas", "1", "--warm-pool-bytes", "2MiB")
    # Rank 0's replica, which the group may push to the replacement (host 1 follows host
    # 0 again), is too large for a warm segment: only rank 1's restore can take one.
    states = [{"w": np.full(n, rank, np.float32)}
              for rank, n in enumerate((1 << 20, 3 << 16, 3 << 16))]  # 4 MiB, 768 KiB
    for rank in range(3):
        c = NumpyClient("ring", rank, 3, ClientOptions(daemon=ring.daemons[rank].address))
        assert c.snapshot(0, states[rank]).taken
        c.close()
    wait_for(lambda: all(s.committed for s in ring.daemons[0].stub.Status(
        pb.StatusRequest(job="ring"), timeout=10).jobs[0].steps), "step 0 committed")
    ring.daemons[1].kill()
    replacement = ring.replace(1)
    wait_for(filled(replacement, 2 * MIB), "the replacement's warm pool filled")
    assert memory(replacement).warm_segments_taken == 0

    c = NumpyClient("ring", 1, 3, ClientOptions(daemon=replacement.address,
                                                restore_timeout_seconds=60))
    step, restored = c.restore()
    assert (step, c.last_restore_source) == (0, "peer")
    assert restored["w"].tobytes() == states[1]["w"].tobytes()
    # the peer's copy landed in a warm segment, not a new one
    assert memory(replacement).warm_segments_taken == 1
    c.close()


def test_the_pool_makes_the_largest_size_asked_that_fits():
    # a rank's half-state snapshots asked last, a whole-state restore before: the whole
    # one is made (it serves both, cut to size), the halves once it cannot fit
    assert next_size([], [5 * MIB, 10 * MIB], 0, 12 * MIB, 64 * MIB) == 10 * MIB
    assert next_size([10 * MIB], [5 * MIB, 10 * MIB], 0, 16 * MIB, 64 * MIB) == 5 * MIB
    assert next_size([10 * MIB, 5 * MIB], [5 * MIB, 10 * MIB], 0, 16 * MIB, 64 * MIB) == 0
    assert next_size([10 * MIB], [5 * MIB, 10 * MIB], 0, 20 * MIB, 64 * MIB) == 10 * MIB
    assert next_size([], [5 * MIB, 10 * MIB], 0, 12 * MIB, 8 * MIB) == 5 * MIB  # the budget
    assert next_size([], [5 * MIB], 4 * MIB, 8 * MIB, 64 * MIB) == 0  # one being made
    assert next_size([], [], 0, 8 * MIB, 64 * MIB) == 8 * MIB  # nothing asked yet: it all
    assert next_size([8 * MIB], [], 0, 8 * MIB, 64 * MIB) == 0


def _mapped_bytes(path: str) -> int:
    """The bytes of ``path``'s mapping in this process that have page-table entries (Rss)."""
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    at = next(i for i, line in enumerate(lines) if line.endswith(" " + path))
    rss = next(line for line in lines[at + 1:] if line.startswith("Rss:"))
    return int(rss.split()[1]) * 1024


def test_a_fresh_segment_the_daemon_fills_is_prefaulted_on_the_workers(tmp_path):
    # A segment the daemon writes whole (a copy landing, a restore cut or pulled) faults
    # its pages in on every core before the bytes come, not one by one under the copy.
    from concurrent.futures import ThreadPoolExecutor

    from bubblesnap.service.store.segments import Segment
    segment = Segment(str(tmp_path / "seg"), 80 * MIB)  # three pieces, the last short
    try:
        assert _mapped_bytes(segment.path) == 0 and not segment.faulted
        with ThreadPoolExecutor(2) as workers:
            segment.prefault(workers)
        assert segment.faulted and _mapped_bytes(segment.path) == 80 * MIB
        assert not segment.view.any()  # the pages fallocate reserved: still zeros
    finally:
        segment.destroy()
