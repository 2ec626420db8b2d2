"""examples/failover.py end to end, both ways, several times: a host (or two adjacent hosts)
killed with SIGKILL after a committed step, the job resumed from a step at least as new as
the one it may not lose: the committed step for one host, the durable one for two."""

import os

import pytest

from tests.helpers import run_example

#: Runs of each way; raise it (BUBBLESNAP_FAILOVER_RUNS=10) for a longer trial. The first
#: runs in make test, the repeats in make test-all (marked slow).
RUNS = int(os.environ.get("BUBBLESNAP_FAILOVER_RUNS", "2"))


@pytest.mark.parametrize("run", [pytest.param(run, marks=[pytest.mark.slow] if run else [])
                                 for run in range(RUNS)])
@pytest.mark.parametrize("flags, killed, sources", [
    # memory: the survivors re-replicated stage 1's copies to the replacement first;
    # durable: the durable tier held a newer whole step than memory did (each daemon
    # writes its LOCAL copies while their replication to peers may still lag)
    ((), [1], ("peer", "memory", "durable")),
    # the copies the ring placed of stage 1 died with its hosts: durable, unless a
    # survivor held the step restored (a copy re-replication made; see below)
    (("--kill-adjacent", "2", "--replicas", "1"), [1, 2], ("durable",)),
])
def test_failover_resumes_from_a_step_at_least_as_new_as_the_safe_one(flags, killed,
                                                                       sources, run):
    code, report = run_example("failover.py", *flags)
    assert code == 0 and report["state_matches_snapshot"], report
    assert report["killed_hosts"] == killed
    assert report["restored_step"] >= report["safe_at_kill"], report
    if killed == [1]:  # a copy of every committed step outlived the one host
        assert report["restored_step"] >= report["committed_at_kill"], report
    if report["restored_step"] in report["stage1_steps_on_survivors"]:
        # a survivor held a copy of stage 1 at that step at the kill (it was made by
        # re-replication: stage 1's copy on host 1 was freed first, host 2's replica
        # stayed and was pushed on to host 0): memory, peer or disk may serve it
        sources = ("peer", "memory", "durable")
    assert report["source"] in sources, report
