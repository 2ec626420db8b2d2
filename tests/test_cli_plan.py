"""``bubblesnap plan``: a simulated pipeline's bubbles planned by the daemon's planner, and
a running daemon's plan asked for, through the installed command line."""

import json
import subprocess
import sys

import numpy as np
import pytest

from bubblesnap.clients import ClientOptions, NumpyClient
from bubblesnap.protos import daemon_pb2 as pb


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bubblesnap", "plan", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_profile_is_simulated_and_planned(schedule):
    small = plan("--stages", "4", "--microbatches", "8", "--forward-ms", "10",
                 "--schedule", schedule, "--state", "64MiB", "--json")
    assert small.returncode == 0, small.stderr
    report = json.loads(small.stdout)
    assert len(report["ranks"]) == 4
    for rank in report["ranks"]:  # each stage idles (p-1)(f+b) per iteration
        assert rank["bubble_seconds"] == pytest.approx(3 * (0.010 + 0.020))
    # 64 MiB at 10 GB/s fits one iteration's 90 ms of bubbles: every step, nothing spilled
    assert (report["interval"], report["spill_bytes"]) == (1, 0)
    assert all(r["chunks"] >= 1 for r in report["ranks"])

    big = plan("--stages", "4", "--schedule", schedule, "--state", "8GiB",
               "--max-interval", "1", "--json")
    report = json.loads(big.stdout)
    assert report["interval"] == 1 and report["spill_bytes"] > 0
    assert report["predicted_overhead"] > 0
    text = plan("--stages", "4", "--schedule", schedule, "--state", "8GiB",
                "--max-interval", "1").stdout
    assert "snapshot every 1 iteration(s)" in text and "stage 3:" in text


def test_bad_flags_and_an_unknown_job_are_refused(start_daemon):
    refused = plan("--stages", "0")
    assert refused.returncode == 2 and "--stages must be >= 1" in refused.stderr
    daemon = start_daemon()
    no_job = plan("--daemon", daemon.address)
    assert no_job.returncode == 2 and "--daemon needs --job" in no_job.stderr
    unknown = plan("--daemon", daemon.address, "--job", "nobody")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr


def test_a_running_daemons_plan_is_printed(start_daemon):
    daemon = start_daemon()
    client = NumpyClient("planned", options=ClientOptions(daemon=daemon.address))
    client.register({"w": np.zeros(1 << 18, np.float32)})

    def report(iteration):
        return pb.BubbleEvent(job="planned", rank=0, kind=pb.BubbleEvent.REPORT,
                              iteration=iteration, iteration_seconds=0.1,
                              reports=[pb.BubbleReport(position=p, measured_seconds=0.01)
                                       for p in range(2)])

    start = pb.BubbleEvent(job="planned", rank=0, kind=pb.BubbleEvent.START, iteration=2)
    [answer] = list(daemon.stub.Bubbles(iter([report(0), report(1), start]), timeout=10))
    shown = plan("--daemon", daemon.address, "--job", "planned", "--json")
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    assert report["interval"] == answer.interval >= 1
    [rank] = report["ranks"]
    assert rank["bubbles"] == 2 and rank["step_bytes"] >= 1 << 20
    client.close()
