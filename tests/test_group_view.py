"""The group's view of its copies: pure functions, no daemons."""

from bubblesnap.service.peers.group_view import (
    Holding,
    committed_steps,
    holders,
    kept_committed,
    newly_held,
    re_replication,
    restorable_steps,
    roundest,
    successors,
)


def ring_copies(steps, hosts=3, replicas=1):
    """Rank r lives on host r and its replicas on the next hosts."""
    return [Holding((r + i) % hosts, r, s, i > 0)
            for s in steps for r in range(hosts) for i in range(replicas + 1)]


def test_committed_needs_every_rank_with_k_plus_one_copies():
    holdings = ring_copies([1, 2])
    assert committed_steps(3, holdings, 2) == [1, 2]
    missing_replica = [h for h in holdings if not (h.rank == 1 and h.step == 2 and h.replica)]
    assert committed_steps(3, missing_replica, 2) == [1]
    assert committed_steps(3, missing_replica, 1) == [1, 2]
    assert committed_steps(4, holdings, 1) == []  # rank 3 holds nothing


def test_restorable_counts_any_copy_or_the_durable_tier():
    holdings = [h for h in ring_copies([5, 6]) if h.index not in (1, 2)]  # hosts 1, 2 gone
    assert restorable_steps(3, holdings) == []  # rank 1 lived on hosts 1 and 2 only
    assert restorable_steps(3, holdings, durable_steps=[4, 6]) == [4, 6]


def test_successors_skip_dead_daemons_in_ring_order():
    assert successors(2, 4, {0, 1, 2, 3}, 2) == [3, 0]
    assert successors(2, 4, {0, 1, 2}, 2) == [0, 1]
    assert successors(0, 3, {0}, 1) == []


def test_re_replication_after_a_death_is_done_once_by_the_first_live_holder():
    holdings = [h for h in ring_copies([7]) if h.index != 1]
    live = {0, 2}
    work = {i: re_replication(i, 3, live, holdings, 2) for i in live}
    # rank 0 was on 0 and 1 -> 0 pushes to 2; rank 1 was on 1 and 2 -> 2 pushes to 0
    assert work[0] == [(0, 7, [2])]
    assert work[2] == [(1, 7, [0])]
    # rank 2 is on 2 and 0: both live, nothing to do


def test_re_replication_leaves_steps_below_the_retention_floor():
    holdings = [h for h in ring_copies([3, 4]) if h.index != 1]
    assert [w[1] for w in re_replication(0, 3, {0, 2}, holdings, 2, floor=4)] == [4]


def test_re_replication_leaves_new_copies_to_their_paced_push():
    # Steps 5 and 6 of rank 0 are held only by daemon 0: 5 was skipped when replication
    # fell behind (the push went to 6, whose peer then died), 6 lost its holder.
    holdings = [Holding(0, 0, 5), Holding(0, 0, 6)]
    assert re_replication(0, 3, {0, 2}, holdings, 2) == [(0, 5, [2]), (0, 6, [2])]
    assert re_replication(0, 3, {0, 2}, holdings, 2, unpushed={(0, 5)}) == [(0, 6, [2])]


def test_no_target_left_means_no_work():
    holdings = [Holding(0, 0, 1)]
    assert re_replication(0, 2, {0}, holdings, 2) == []


def test_roundest_step_is_common_to_daemons_behind_by_different_amounts():
    assert roundest([5]) == 5
    assert roundest([9, 10, 11, 12, 13]) == 12
    assert roundest([13, 14, 15]) == 14
    assert roundest([7, 8, 9]) == 8 and roundest([5, 6, 7, 8]) == 8
    assert roundest([0, 1, 2]) == 0


def test_a_replica_group_is_held_through_its_copier():
    # Ranks 0 and 1 are one data-parallel group: only rank 0 has copies.
    holdings = [Holding(i, 0, 4, i > 0, group=(0, 1)) for i in range(2)] + \
        [Holding(i, 2, 4, i > 0) for i in (1, 2)]
    assert committed_steps(3, holdings, 2) == [4]
    assert restorable_steps(3, holdings) == [4]
    ungrouped = [Holding(h.index, h.rank, h.step, h.replica) for h in holdings]
    assert committed_steps(3, ungrouped, 1) == []  # rank 1 would need copies of its own
    assert restorable_steps(3, ungrouped) == []


def test_a_step_stays_committed_while_the_group_can_restore_it():
    holdings = ring_copies([4, 6])
    assert kept_committed(3, holdings, 2, held=[2, 4]) == [4, 6]  # 2 is gone
    lost = [h for h in holdings if h.index != 1]  # host 1 died: 4 and 6 lack copies
    assert committed_steps(3, lost, 2) == []
    assert kept_committed(3, lost, 2, held=[4, 6]) == [4, 6]  # still restorable
    # etcd's summary counts a step a rollback dropped until it judges anew
    assert kept_committed(3, holdings, 2, summary=([4, 6], [4, 6]), rolled_back_to=4) == [4]
    assert kept_committed(3, holdings, 2, epoch_whole=False) == []


def test_newly_held_names_the_steps_a_copy_of_which_landed_since():
    before = holders(ring_copies([4]))
    now = [*ring_copies([4, 5]), Holding(2, 0, 4, True)]
    assert newly_held(before, now) == {4, 5}
    assert newly_held(holders(now), now) == set()


def test_a_step_is_not_judged_committed_on_a_silent_peers_last_answer():
    holdings = ring_copies([4])  # host 1's part is what it answered last
    assert kept_committed(3, holdings, 2) == [4]
    assert kept_committed(3, holdings, 2, stale={1}) == []
    # a step already taken as committed stays while those copies say it is restorable
    assert kept_committed(3, holdings, 2, held=[4], stale={1}) == [4]


def test_one_resume_one_step_for_every_rank():
    """peers/resume_rule.py: the first rank's restore opens a resume at the newest step
    every rank can restore; the other ranks take it, whatever they could restore by then,
    until every rank took it or a later step can be restored (the job moved on)."""
    from bubblesnap.service.peers.resume_rule import Resume, decider, resume_step

    first = resume_step(None, [8, 12, 16], rank=0, world=3)
    assert first == Resume(16, frozenset({0}))
    # copies landing and freed meanwhile (12 freed, 20 not whole): still 16 for the rest
    second = resume_step(first, [8, 16], rank=2, world=3)
    assert second == Resume(16, frozenset({0, 2}))
    # its step lost since (more copies gone): a new resume
    assert resume_step(first, [8, 12], rank=2, world=3) == Resume(12, frozenset({2}))
    assert resume_step(second, [16], rank=2, world=3) == second  # a rank asking again
    done = resume_step(second, [16], rank=1, world=3)
    assert done.ranks == {0, 1, 2}
    # every rank took it: the next restore without a step is a new resume
    assert resume_step(done, [16, 17], rank=1, world=3) == Resume(17, frozenset({1}))
    # a later step restorable before every rank took it: the job moved on
    assert resume_step(first, [16, 20], rank=1, world=3) == Resume(20, frozenset({1}))
    assert resume_step(None, [], rank=0, world=3) is None
    assert decider(2, {0, 1}) == 0 and decider(1, {2}) == 1 and decider(-1, set()) == -1
