"""examples/lossless.py end to end: a pipeline SIGKILLed mid-training resumes bit for bit.

The runs share their reference run (no failure, no snapshot: the same for every test of a
scope) through --reference-cache, one JAX program's worth of processes less per test.
"""

import pytest

from tests.helpers import run_example


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("lossless-reference"))


def lossless(cache: str, *flags: str) -> tuple[int, dict]:
    return run_example("lossless.py", "--steps", "12", "--reference-cache", cache, *flags,
                       timeout=600)


@pytest.mark.parametrize("flags", [
    ("--fail-at", "8", "--fail-point", "bubble"),
    ("--fail-at", "6", "--fail-point", "after-commit"),
    ("--fail-at", "9", "--fail-point", "bubble", "--fail-during-replay", "1"),
], ids=["mid-bubble-fetch", "after-commit", "during-replay"])
def test_failure_is_replayed_bit_for_bit(cache, flags):
    code, report = lossless(cache, *flags)
    assert report["bitwise_equal"] is True, report
    assert report["lost_steps"] == 0, report
    assert report["replayed_steps"] >= 1, report  # the snapshot alone was behind
    assert code == 0


def test_without_the_log_the_resumed_run_diverges(cache):
    code, report = lossless(cache, "--fail-at", "8", "--fail-point", "bubble", "--without-log")
    assert report["bitwise_equal"] is False and code == 1, report


def test_one_failed_stage_replays_alone_from_the_boundary_logs(cache):
    # Stage 1 dies before its last gradient reaches stage 0: stage 2 finished the
    # step, stage 0 did not and replays that one step from its own memory.
    code, report = lossless(cache, "--fail-scope", "stage", "--fail-stage", "1", "--fail-at", "8",
                            "--fail-after-sends", "7")
    assert report["bitwise_equal"] is True, report
    assert report["lost_steps"] == 0, report
    assert report["stages_rolled_back"] == 1 and report["rolled_back"] == [1], report
    assert report["survivors_finished"] == {"0": 7, "2": 8}, report
    assert report["replayed_steps_by_stage"] == {"0": 1, "1": 8 - report["restored_step"],
                                                 "2": 0}, report
    assert report["boundary_log_bytes_per_step"] == sum(report["bytes_per_step_by_boundary"])
    assert code == 0


def test_under_a_log_budget_the_failed_stages_group_rolls_back(cache):
    # Room for one of the two (equal) boundaries: which one depends on the stage times
    # the reference run measured; the middle stage is grouped with a neighbour either way.
    code, report = lossless(cache, "--fail-scope", "stage", "--fail-stage", "1", "--fail-at", "9",
                            "--log-budget", "300000")
    assert len(report["log_groups"]) == 2 and len(report["logged_boundaries"]) == 1, report
    group = next(g for g in report["log_groups"] if 1 in g)
    assert report["rolled_back"] == group and report["stages_rolled_back"] == 2, report
    assert report["bitwise_equal"] is True and report["lost_steps"] == 0, report
    assert report["replayed_steps"] >= 1, report
    assert report["boundary_log_bytes_per_step"] == \
        report["bytes_per_step_by_boundary"][report["logged_boundaries"][0]] <= 300000
    sizes = [t["log_bytes_per_step"] for t in report["trade_off"]]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] == 0, report
    assert code == 0


def test_two_replay_workers_replay_the_failed_stages_steps_bit_for_bit(cache):
    # Stage 1 dies early in step 10: both neighbours finished 9, so steps 8 and 9 are
    # replayed from the logs alone, each by two workers, the update of 8 reaching both
    # before 9.
    code, report = lossless(cache, "--fail-scope", "stage", "--fail-stage", "1", "--fail-at", "10",
                            "--replay-workers", "2")
    assert report["bitwise_equal"] is True and report["lost_steps"] == 0, report
    assert report["replay_workers"] == 2, report
    replay = report["failed_stage_replay"]
    assert report["replayed_steps"] == 10 - 1 - report["restored_step"] == 2, report
    assert replay["steps_by_the_workers"] == 2 == len(replay["step_seconds"]), report
    # a step goes to the workers whose compile finished: the stage's own device always
    assert set(replay["workers_by_step"]) <= {1, 2} and len(replay["workers_by_step"]) == 2
    assert replay["warm_up_seconds_by_device"][0] > 0, report
    assert code == 0
