"""A progress bar for a restore that takes more than a moment (bytes, rate, time left).

The restore is one call; the daemon reads the copy meanwhile (from a peer,
from the durable tier) and reports how far it got in Status (``in_flight``).
While the call runs, a thread asks every ``interval`` seconds and moves a
tqdm bar on stderr; a restore that answers within ``after`` seconds shows none.
"""

import contextlib
import threading

import grpc
from tqdm import tqdm

from bubblesnap.protos import daemon_pb2 as pb


@contextlib.contextmanager
def restore_progress(stub, job: str, rank: int, enabled: bool, after: float = 0.5,
                     interval: float = 0.2, timeout: float = 5.0):
    """Shows the daemon's progress on ``rank``'s restore of ``job`` while the block runs."""
    if not enabled:
        yield
        return
    finished, outcome = threading.Event(), {"whole": False}
    thread = threading.Thread(target=_follow, args=(stub, job, rank, finished, outcome, after,
                                                    interval, timeout),
                              name="restore-progress", daemon=True)
    thread.start()
    try:
        yield
        outcome["whole"] = True  # the daemon answered: every byte is there
    finally:
        finished.set()
        thread.join(timeout=timeout + 1)


def _follow(stub, job: str, rank: int, finished: threading.Event, outcome: dict,
            after: float, interval: float, timeout: float) -> None:
    if finished.wait(after):
        return
    bar = None
    try:
        while not finished.is_set():
            try:
                status = stub.Status(pb.StatusRequest(job=job), timeout=timeout)
            except grpc.RpcError:
                status = None  # the job is not registered yet, or the daemon is busy
            work = next((w for w in status.in_flight if w.kind == "restore"
                         and w.job == job and w.rank == rank), None) if status else None
            if work is not None and work.total_bytes:
                if bar is None:
                    bar = tqdm(total=work.total_bytes, unit="B", unit_scale=True,
                               unit_divisor=1024, desc=f"restore step {work.step}",
                               leave=True)
                bar.total = max(bar.total, work.total_bytes)
                bar.update(work.done_bytes - bar.n)
            finished.wait(interval)
    finally:
        if bar is not None:
            if outcome["whole"]:
                bar.update(bar.total - bar.n)
            bar.close()
