"""make soak's quick variant (tests/soak.py --quick): two loop rounds on a cluster lab, a
2-process job's trainers SIGKILLed right after a save, then a host (its trainer and its
daemon) killed and the daemon replaced with an empty memory; every resume judged by the
history checker (the same step on every rank, committed, bit for bit, no older than the
fault keeps), and the summary line counts what it struck."""

import json
import subprocess
import sys

import pytest

from bubblesnap.testing import cluster
from tests.helpers import ROOT


def test_the_quick_soak_strikes_twice_and_every_resume_keeps_the_contract():
    reason = cluster.unavailable()
    if reason:
        pytest.skip(reason)
    proc = subprocess.run([sys.executable, "-m", "tests.soak", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    struck = {kind.rsplit(" (", 1)[0]: n for kind, n in summary["faults"].items()}
    assert struck == {"trainer killed right after save": 1,
                      "host killed, daemon replaced empty": 1}, summary
    assert summary["resumes"] == 2 and summary["violations"] == 0, summary
    assert "restored" in proc.stderr and "held" in proc.stderr
