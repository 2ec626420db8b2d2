"""The history checker: each way a history breaks the contract is found, and a history
that keeps it passes."""

import pytest

from bubblesnap.testing.history import History, violations


def history_to(step: int, at: float = 10.0) -> History:
    """Steps 0..step committed one a second, two ranks, digests "r<rank>s<step>"."""
    history = History()
    for s in range(step + 1):
        history.committed("job", s, {0: f"r0s{s}", 1: f"r1s{s}"}, at=float(s))
    history.fault("host 1 killed", keeps="committed", at=at)
    return history


def restore(history: History, steps, digests=None, at: float = 20.0) -> History:
    digests = digests or {r: f"r{r}s{s}" for r, s in steps.items()}
    history.restored("job", steps, digests, at=at)
    return history


def test_a_restore_of_the_newest_committed_step_keeps_the_contract():
    assert violations(restore(history_to(5), {0: 5, 1: 5})) == []


def test_an_older_step_than_the_fault_keeps_is_found():
    found = violations(restore(history_to(5), {0: 4, 1: 4}))
    assert found == ["job: restored step 4, older than step 5, which was committed before "
                     "'host 1 killed' (which keeps it)"]


def test_a_step_committed_after_the_fault_is_not_required():
    history = history_to(5, at=3.5)  # steps 4 and 5 came after the fault
    assert violations(restore(history, {0: 3, 1: 3})) == []
    assert violations(restore(history_to(5, at=3.5), {0: 2, 1: 2}))


def test_a_mixed_a_torn_and_an_uncommitted_step_are_found():
    assert "mixed" in violations(restore(history_to(5), {0: 5, 1: 4}))[0]
    torn = violations(restore(history_to(5), {0: 5, 1: 5}, {0: "r0s5", 1: "r1s4"}))
    assert torn == ["job: restored step 5 with bytes that are not those committed (ranks [1])"]
    assert "never committed" in violations(restore(history_to(5), {0: 6, 1: 6}))[0]


def test_every_rank_of_one_resume_restoring_the_same_step_is_checked():
    """Ranks recorded one by one as each restores: judged together, per resume."""
    history = history_to(5)
    history.rank_restored("job", "after host 1", 0, 5, "r0s5", at=20.0)
    history.rank_restored("job", "after host 1", 1, 5, "r1s5", at=21.0)
    assert violations(history) == []
    history.rank_restored("job", "after host 2", 0, 5, "r0s5", at=30.0)
    history.rank_restored("job", "after host 2", 1, 4, "r1s4", at=31.0)
    [found] = violations(history)
    assert "the ranks of one resume restored different steps" in found and "{0: 5, 1: 4}" in found


def test_a_fault_that_keeps_the_durable_step_only_needs_that_one():
    history = history_to(5)
    history.faults.clear()
    history.durable("job", 2, at=2.5)
    history.fault("hosts 1 and 2 killed", keeps="durable", at=10.0)
    assert violations(restore(history, {0: 2, 1: 2})) == []
    assert "older than step 2" in violations(restore(history, {0: 1, 1: 1}))[0]


def test_two_daemons_publishing_under_one_index_at_once_are_found():
    history = History()
    history.published(0, "daemon a", start=0.0, end=5.0)
    history.published(0, "daemon b", start=5.0)  # took over when a stopped: fine
    history.published(1, "daemon c", start=0.0)
    assert violations(history) == []
    history.published(1, "daemon d", start=3.0)
    assert violations(history) == ["ring index 1: daemon c and daemon d published under it "
                                   "at once (from 3.000)"]


def test_a_fault_names_what_it_keeps():
    with pytest.raises(ValueError, match="keeps='everything'"):
        History().fault("x", keeps="everything")
