"""Long work is visible while it runs: a durable write of a 256 MiB step shows in Status
(``in_flight``, bytes done of the total) and in ``bubblesnap status``, and is gone once
written; the Progress registry itself under threads."""

import signal
import subprocess
import sys
import threading
import time

import numpy as np

from bubblesnap.clients import ClientOptions, NumpyClient
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.service.progress import Progress


def test_progress_tracks_bytes_from_many_threads_and_forgets_what_ended():
    progress = Progress()
    with progress.track("restore", "j", 3, 7, 1000) as done:
        threads = [threading.Thread(target=lambda: [done(1) for _ in range(100)])
                   for _ in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        [work] = progress.in_flight("j")
        assert (work.kind, work.rank, work.step, work.done_bytes, work.total_bytes) == \
            ("restore", 3, 7, 400, 1000)
        assert work.seconds_left is not None and progress.in_flight("other") == []
        done(10_000)  # never past the total
        assert progress.in_flight()[0].done_bytes == 1000
    assert progress.in_flight() == []


def test_a_durable_write_in_flight_shows_in_status(start_daemon, tmp_path):
    daemon = start_daemon("--durable-dir", str(tmp_path / "durable"),
                          "--durable-every-steps", "1", "--memory-budget", "2GiB")
    client = NumpyClient("big", options=ClientOptions(daemon=daemon.address))
    state = {f"w{i}": np.full(1 << 24, i, np.float32) for i in range(4)}  # 256 MiB
    assert client.snapshot(1, state, wait=True).taken
    seen, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        status = daemon.stub.Status(pb.StatusRequest(job="big"), timeout=10)
        seen += [w for w in status.in_flight if w.kind == "persist"]
        if list(status.jobs[0].durable_steps) == [1]:
            break
        time.sleep(0.01)
    assert seen, "the write was never reported in flight"
    assert all(w.job == "big" and w.step == 1 and w.total_bytes == 1 << 28 and
               0 <= w.done_bytes <= w.total_bytes for w in seen)
    after = daemon.stub.Status(pb.StatusRequest(job="big"), timeout=10)
    assert list(after.jobs[0].durable_steps) == [1] and not after.in_flight

    client.close()


def test_status_watch_redraws_until_interrupted(start_daemon):
    daemon = start_daemon()
    watch = subprocess.Popen([sys.executable, "-m", "bubblesnap", "status", "--daemon",
                              daemon.address, "--watch", "0.2"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    drawn = ""
    try:  # three redraws, however long the command takes to start
        while drawn.count("memory: ") < 3:
            line = watch.stdout.readline()
            assert line, watch.stderr.read()
            drawn += line
    finally:
        watch.send_signal(signal.SIGINT)
        _, err = watch.communicate(timeout=30)
    assert watch.returncode == 0, err
    assert "Traceback" not in err


def test_a_restore_from_the_durable_tier_shows_its_progress(start_daemon, tmp_path, capfd):
    durable = str(tmp_path / "durable")
    flags = ("--durable-dir", durable, "--durable-every-steps", "1", "--memory-budget", "3GiB")
    writer = start_daemon(*flags)
    state = {f"w{i}": np.full(1 << 25, i, np.float32) for i in range(4)}  # 512 MiB
    client = NumpyClient("far", options=ClientOptions(daemon=writer.address))
    assert client.snapshot(1, state, wait=True).taken
    client.close()
    deadline = time.monotonic() + 120
    while 1 not in writer.stub.Status(pb.StatusRequest(job="far"), timeout=10).jobs[0] \
            .durable_steps:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    writer.kill()

    fresh = start_daemon(*flags)  # empty memory: the step comes from disk
    seen, reading = [], []  # reading: seconds since the call while bytes were counted
    for _ in range(3):  # a restore faster than the polling shows nothing: try again
        restorer = NumpyClient("far", options=ClientOptions(daemon=fresh.address,
                                                             show_progress=True))
        result, started = {}, time.monotonic()
        thread = threading.Thread(target=lambda r=result, c=restorer: r.update(got=c.restore()))
        thread.start()
        while thread.is_alive():
            status = fresh.stub.Status(pb.StatusRequest(), timeout=10)
            works = [w for w in status.in_flight if w.kind == "restore"]
            seen += works
            if any(w.total_bytes for w in works):
                reading.append(time.monotonic() - started)
            time.sleep(0.01)
        thread.join()
        step, got = result["got"]
        assert step == 1 and all(got[k].tobytes() == v.tobytes() for k, v in state.items())
        restorer.close()
        fresh.stub.DeleteSnapshots(pb.DeleteSnapshotsRequest(job="far"), timeout=10)
        if seen:
            break
    assert seen, "no restore was ever reported in flight"
    assert all(w.job == "far" and w.step == 1 and 0 <= w.done_bytes <= w.total_bytes
               <= 1 << 29 for w in seen), seen[:3]
    # the total grows to the step's bytes as the reads start (0 before the plan is made)
    assert any(w.total_bytes == 1 << 29 for w in seen), seen[:3]
    # The bar's thread asks from half a second on, every 0.2 s: it saw the bytes being
    # counted if they were for long enough after that.
    if reading and reading[-1] - max(reading[0], 0.6) > 0.5:
        assert "restore step 1" in capfd.readouterr().err
