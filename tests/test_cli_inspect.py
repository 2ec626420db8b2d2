"""``bubblesnap inspect``: a real daemon's durable tier listed as it was written, verified,
and a damaged step found (exit 1, named), through the installed command line."""

import json
import os
import subprocess
import sys

import numpy as np

from bubblesnap.clients import ClientOptions, NumpyClient
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.testing import wait_for

STATE = {"w": np.arange(1 << 16, dtype=np.float32).reshape(256, 256),
         "b": np.arange(256, dtype=np.int32)}


def inspect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bubblesnap", "inspect", *args],
                          capture_output=True, text=True, timeout=120)


def test_inspect_lists_verifies_and_finds_damage(start_daemon, tmp_path):
    durable = tmp_path / "durable"
    daemon = start_daemon("--durable-dir", str(durable), "--durable-every-steps", "1")
    client = NumpyClient("ins", options=ClientOptions(daemon=daemon.address))
    for step in (1, 2):
        assert client.snapshot(step, {k: v + step for k, v in STATE.items()}, wait=True).taken
    client.close()
    wait_for(lambda: list(daemon.stub.Status(pb.StatusRequest(job="ins"), timeout=5)
                          .jobs[0].durable_steps) == [1, 2], "two durable steps", timeout=60)
    daemon.kill()

    listed = inspect(str(durable), "--json", "--verify")
    assert listed.returncode == 0, listed.stderr
    report = json.loads(listed.stdout)
    [job] = report["jobs"]
    assert job["job"] == "ins" and [s["step"] for s in job["steps"]] == [1, 2]
    for step in job["steps"]:
        assert step["finalized"] and step["verified"] is True
        [rank] = step["ranks"]
        tensors = {t["name"]: t for t in rank["tensors"]}
        assert tensors["w"]["shape"] == [256, 256] and tensors["w"]["dtype"] == "float32"
        assert step["bytes"] == sum(v.nbytes for v in STATE.values())
    assert "verify" in listed.stderr  # the progress bar

    # Flip a byte in step 2's data files: inspect names the step and exits 1.
    for root, _, files in os.walk(durable / "ins" / "step_2"):
        if os.path.basename(root) == "d":
            for name in files:
                with open(os.path.join(root, name), "r+b") as f:
                    data = bytearray(f.read())
                    data[len(data) // 2] ^= 0xFF
                    f.seek(0)
                    f.write(data)
    damaged = inspect(str(durable), "--verify", "--no-progress")
    assert damaged.returncode == 1, damaged.stdout
    assert "DAMAGED: job 'ins' step 2" in damaged.stdout
    assert "step 1: " in damaged.stdout and "verified" in damaged.stdout
    assert "verify" not in damaged.stderr

    missing = inspect(str(tmp_path / "nothing"))
    assert missing.returncode == 1 and "is not a directory" in missing.stderr
