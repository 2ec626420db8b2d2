"""examples/data_parallel.py end to end: a SIGKILLed data-parallel worker is recovered.

Real worker processes, a real daemon and real JAX: from the surviving replica
after undoing its extra update (SGD with momentum, AdamW), or from the
snapshot and the training log when the optimizer has no inverse or the undo
error passes the bound.
"""

import pytest

from tests.helpers import run_example


def data_parallel(*flags: str) -> tuple[int, dict]:
    return run_example("data_parallel.py", "--steps", "12", *flags, timeout=300)


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adamw"])
def test_worker_is_recovered_from_the_replica_after_an_undo(optimizer):
    code, report = data_parallel("--optimizer", optimizer, "--fail-at", "6")
    assert report["recovered_from"] == "replica" and report["snapshot_used"] is False, report
    assert report["restored_step"] is None, report
    assert report["undo_check"]["within_bound"] is True, report
    # Really undone (float32 rounding leaves a trace), and close to the true state.
    assert report["undo_bound"] == 1e-5, report
    assert 0 < report["undo_error"] <= 1e-5, report
    assert report["undo_abs_error"] < 1e-5, report
    assert report["max_abs_diff_vs_reference"] < 1e-4, report
    assert report["replicas_equal"] is True, report
    assert report["finished_before_failure"] == 5 and report["lost_steps"] == 0, report
    assert code == 0


def test_optimizer_without_inverse_falls_back_to_the_snapshot():
    code, report = data_parallel("--optimizer", "adafactor", "--fail-at", "6")
    assert report["recovered_from"] == "snapshot" and report["snapshot_used"] is True, report
    assert "no inverse" in report["fallback_reason"], report
    assert report["undo_error"] is None and report["undo_check"] is None, report
    assert report["restored_step"] == 3 and report["replayed_steps"] == 3, report
    assert report["bitwise_equal"] is True, report
    assert report["max_abs_diff_vs_reference"] == 0.0, report
    assert report["lost_steps"] == 0, report
    assert code == 0


def test_undo_error_past_the_bound_falls_back_to_the_snapshot():
    # Step 7 is a snapshot step: worker 0 finished it alone, so its snapshot never
    # exists and the job restores step 3.
    code, report = data_parallel("--optimizer", "sgd-momentum", "--fail-at", "7",
                                 "--undo-bound", "0")
    assert report["undo_check"]["within_bound"] is False, report
    assert report["undo_error"] is not None, report  # undone, measured, then rejected
    assert report["recovered_from"] == "snapshot" and report["snapshot_used"] is True, report
    assert report["restored_step"] == 3 and report["replayed_steps"] == 4, report
    assert report["bitwise_equal"] is True and report["replicas_equal"] is True, report
    assert report["lost_steps"] == 0, report
    assert code == 0
