"""examples/lossless.py end to end: a pipeline SIGKILLed mid-training resumes bit for bit."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "lossless.py"


def lossless(*flags: str) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "12", *flags],
                          capture_output=True, text=True, timeout=600)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("flags", [
    ("--fail-at", "8", "--fail-point", "bubble"),
    ("--fail-at", "6", "--fail-point", "after-commit"),
    ("--fail-at", "9", "--fail-point", "bubble", "--fail-during-replay", "1"),
], ids=["mid-bubble-fetch", "after-commit", "during-replay"])
def test_failure_is_replayed_bit_for_bit(flags):
    code, report = lossless(*flags)
    assert report["bitwise_equal"] is True, report
    assert report["lost_steps"] == 0, report
    assert report["replayed_steps"] >= 1, report  # the snapshot alone was behind
    assert code == 0


def test_without_the_log_the_resumed_run_diverges():
    code, report = lossless("--fail-at", "8", "--fail-point", "bubble", "--without-log")
    assert report["bitwise_equal"] is False and code == 1, report
