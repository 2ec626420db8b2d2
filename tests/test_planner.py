"""The bubble planner on crafted profiles, and one property test over random ones.

Most profiles use a fetch bandwidth of 1 MiB/s, bubble lengths that are binary
fractions of a second and ``safety=0.5`` with no per-bubble cost, so every
capacity is an exact number of bytes (a 1 s bubble holds 512 KiB) and the
expected plans can be worked out by hand.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bubblesnap.service.bubbles.planner import (
    Chunk,
    PlannerOptions,
    RankPlan,
    RankProfile,
    assign,
    bubble_capacity,
    iterations_needed,
    plan,
)

KiB = 1 << 10
MiB = 1 << 20
EXACT = PlannerOptions(safety=0.5, per_bubble_seconds=0.0, min_bubble_seconds=0.1,
                       min_chunk_bytes=256 * KiB, max_interval=8)


def profile(bubbles, slots, iteration_seconds=4.0, bandwidth=MiB) -> RankProfile:
    """A rank with ``bubbles`` as (position, seconds) and ``slots`` in bytes."""
    return RankProfile(bubbles=tuple(bubbles), iteration_seconds=iteration_seconds,
                       copy_bytes_per_second=bandwidth, slot_bytes=tuple(slots))


def in_schedule_order(prof: RankProfile, rank_plan: RankPlan, interval: int):
    """(key, chunks) of every bubble that got bytes, in the order the bubbles happen."""
    for offset in range(1, interval + 1):
        for position, _ in prof.bubbles:
            if (offset, position) in rank_plan.assignments:
                yield (offset, position), rank_plan.assignments[(offset, position)]


def check_rank(prof: RankProfile, rank_plan: RankPlan, interval: int,
               options: PlannerOptions) -> None:
    """The invariants every rank plan keeps, whatever the profile."""
    seconds = dict(prof.bubbles)
    positions = set(seconds)
    for offset, position in rank_plan.assignments:
        assert 1 <= offset <= interval and position in positions

    # No bubble is given more bytes than it can take, and no bubble gets an empty entry.
    for (_, position), chunks in rank_plan.assignments.items():
        capacity = bubble_capacity(seconds[position], prof.copy_bytes_per_second, options)
        assert chunks and all(c.nbytes > 0 for c in chunks)
        assert sum(c.nbytes for c in chunks) <= capacity

    # Assignments, in schedule order, then the spill cover every byte once, in slot order.
    ordered = [c for _, chunks in in_schedule_order(prof, rank_plan, interval) for c in chunks]
    assert len(ordered) == sum(len(c) for c in rank_plan.assignments.values())
    cursor = [(slot, 0) for slot, n in enumerate(prof.slot_bytes) if n > 0]
    at = 0  # index into cursor: the slot the next chunk must continue
    for chunk in ordered:
        slot, start = cursor[at]
        assert (chunk.slot, chunk.start) == (slot, start)
        assert chunk.stop <= prof.slot_bytes[slot]
        if chunk.stop == prof.slot_bytes[slot]:
            at += 1
        else:
            cursor[at] = (slot, chunk.stop)
    left = sum(prof.slot_bytes[slot] - start for slot, start in cursor[at:])
    assert rank_plan.spill_bytes == left
    assert sum(c.nbytes for c in ordered) + rank_plan.spill_bytes == prof.step_bytes

    # Cuts are never below min_chunk_bytes, except the last piece of a slot.
    for chunk in ordered:
        assert chunk.nbytes >= options.min_chunk_bytes or chunk.stop == prof.slot_bytes[chunk.slot]

    # commit_at is the last bubble that gets bytes (None when none does).
    keys = [key for key, _ in in_schedule_order(prof, rank_plan, interval)]
    assert rank_plan.commit_at == (keys[-1] if keys else None)

    # The overhead is the spill's fetch time spread over the interval.
    spill_seconds = rank_plan.spill_bytes / prof.copy_bytes_per_second
    assert rank_plan.predicted_overhead == pytest.approx(
        spill_seconds / (interval * prof.iteration_seconds))


def check_plan(profiles, options: PlannerOptions):
    """Plans ``profiles``, checks every rank and that the interval is the smallest that fits."""
    result = plan(profiles, options)
    assert result.ranks.keys() == profiles.keys()
    for rank, prof in profiles.items():
        check_rank(prof, result.ranks[rank], result.interval, options)
    assert 1 <= result.interval <= max(1, options.max_interval)
    if result.interval < options.max_interval:
        assert result.spill_bytes == 0
    if result.interval > 1:
        shorter = result.interval - 1
        assert any(assign(p, shorter, options).spill_bytes > 0 for p in profiles.values())
    assert result.spill_bytes == sum(r.spill_bytes for r in result.ranks.values())
    assert result.predicted_overhead == max(r.predicted_overhead for r in result.ranks.values())
    return result


def test_bubble_capacity_applies_safety_cost_and_threshold():
    """A bubble holds safety * length minus the per-bubble cost; short ones hold nothing."""
    options = PlannerOptions(safety=0.5, per_bubble_seconds=0.25, min_bubble_seconds=0.5)
    assert bubble_capacity(1.0, MiB, options) == MiB // 4
    assert bubble_capacity(0.5, MiB, options) == 0           # cost eats it all
    assert bubble_capacity(0.49, MiB, options) == 0          # below min_bubble_seconds
    assert bubble_capacity(0.4, 1e12, options) == 0          # however fast the copy
    assert bubble_capacity(2.0, MiB, options) == 3 * MiB // 4


def test_asymmetric_stages_share_the_interval_of_the_neediest():
    """Four 1F1B stages (warm-up s*f, middle (p-1-s)(f+b), cool-down s*b) with uneven state.

    Stage 0 has one bubble of 1.125 MiB per iteration and 3 MiB of state
    (embedding + its block): it needs three iterations, the others two, and all
    ranks get interval 3. Stage 1's 128 KiB warm-up bubble gets nothing, being
    below min_chunk_bytes against a 1.5 MiB slot.
    """
    p, f, b = 4, 0.25, 0.5
    profiles = {}
    for s in range(p):
        bubbles = [(0, s * f), (1, (p - 1 - s) * (f + b)), (2, s * b)]
        slots = (1 * MiB, 2 * MiB) if s == 0 else (3 * MiB // 2,)
        profiles[s] = profile(bubbles, slots)
    result = check_plan(profiles, EXACT)

    assert result.interval == 3
    assert [iterations_needed(profiles[s], EXACT) for s in range(p)] == [3, 2, 2, 2]
    assert assign(profiles[0], 2, EXACT).spill_bytes > 0
    assert result.spill_bytes == 0 and result.predicted_overhead == 0
    assert dict(result.ranks[0].assignments) == {
        (1, 1): (Chunk(0, 0, MiB),),  # 128 KiB of room left: too small to cut slot 1
        (2, 1): (Chunk(1, 0, 1152 * KiB),),
        (3, 1): (Chunk(1, 1152 * KiB, 2 * MiB),),
    }
    assert result.ranks[0].commit_at == (3, 1)
    assert (1, 0) not in result.ranks[1].assignments
    assert result.ranks[1].assignments[(1, 1)] == (Chunk(0, 0, 768 * KiB),)
    # The last stage finishes in its second iteration, but keeps the job's interval.
    assert result.ranks[3].commit_at == (2, 0)


def test_tiny_bubbles_get_nothing():
    """Bubbles under min_bubble_seconds, or eaten by the per-bubble cost, are never used."""
    options = PlannerOptions(safety=0.5, per_bubble_seconds=0.125, min_bubble_seconds=0.1,
                             min_chunk_bytes=1, max_interval=4)
    tiny = [(0, 0.09), (1, 0.25), (3, 0.0), (4, 0.05)]  # 0.25 s: 0.125 s usable - 0.125 s cost
    prof = profile(sorted([*tiny, (2, 1.0)]), (100 * KiB, 200 * KiB))
    result = check_plan({0: prof}, options)

    rank = result.ranks[0]
    assert set(rank.assignments) == {(1, 2)}
    assert rank.usable_bubbles == 1 and rank.bubble_seconds == 1.0
    assert rank.spill_bytes == 0 and result.interval == 1


def test_only_tiny_bubbles_spill_everything_at_the_longest_interval():
    """With no usable bubble nothing is assigned: all is spilled, over max_interval iterations."""
    options = PlannerOptions(min_bubble_seconds=1e-3, max_interval=5)
    prof = profile([(0, 0.5e-3), (1, 0.9e-3)], (MiB, MiB), iteration_seconds=2.0)
    result = check_plan({7: prof}, options)

    rank = result.ranks[7]
    assert result.interval == 5
    assert rank.assignments == {} and rank.commit_at is None
    assert rank.spill_bytes == 2 * MiB and rank.usable_bubbles == 0
    assert rank.predicted_overhead == pytest.approx(2.0 / (5 * 2.0))


def test_state_larger_than_one_iteration_spreads_over_several():
    """2.5 iterations' worth of state takes an interval of 3, filled in schedule order."""
    prof = profile([(0, 1.0), (5, 1.0)], (MiB, MiB, MiB // 2))  # 1 MiB per iteration
    result = check_plan({0: prof}, EXACT)

    assert result.interval == 3
    assert result.spill_bytes == 0
    assert sorted(result.ranks[0].assignments) == [(1, 0), (1, 5), (2, 0), (2, 5), (3, 0)]
    assert result.ranks[0].commit_at == (3, 0)


@pytest.mark.parametrize("max_interval", [1, 2])
def test_state_too_large_for_max_interval_is_spilled(max_interval):
    """What the allowed iterations cannot hold is spilled, and priced as a stall.

    One iteration's bubbles hold 768 KiB of a 2 MiB state; the rest is
    fetched while training waits: overhead = spill seconds / (interval * iteration).
    """
    options = PlannerOptions(safety=0.5, per_bubble_seconds=0.0, min_bubble_seconds=0.1,
                             min_chunk_bytes=1, max_interval=max_interval)
    big = profile([(0, 1.0), (1, 0.5)], (2 * MiB,), iteration_seconds=4.0)
    small = profile([(0, 1.0), (1, 0.5)], (256 * KiB,), iteration_seconds=4.0)
    result = check_plan({0: big, 1: small}, options)

    assert result.interval == max_interval
    spill = 2 * MiB - max_interval * 768 * KiB
    assert result.ranks[0].spill_bytes == result.spill_bytes == spill
    assert result.ranks[1].spill_bytes == 0
    spill_seconds = spill / MiB
    assert result.predicted_overhead == pytest.approx(spill_seconds / (max_interval * 4.0))
    if max_interval == 1:
        assert result.ranks[0].predicted_overhead == pytest.approx(spill_seconds / 4.0)


def test_one_much_slower_stage_drives_the_interval():
    """A much slower stage rarely idles while the others wait for it.

    Its bubbles shrink (0.5 s: 256 KiB each) and everyone else's grow (2 s:
    1 MiB each). With 2 MiB of state per stage the others would snapshot every
    iteration; the slow stage needs four, and the whole job takes four.
    """
    fast = [(0, 2.0), (1, 2.0)]
    slow = [(0, 0.5), (1, 0.5)]
    profiles = {s: profile(slow if s == 2 else fast, (2 * MiB,), iteration_seconds=8.0)
                for s in range(4)}
    result = check_plan(profiles, EXACT)

    assert iterations_needed(profiles[2], EXACT) == 4
    assert result.interval == 4
    assert plan({s: profiles[s] for s in (0, 1, 3)}, EXACT).interval == 1
    assert all(result.ranks[s].commit_at == (1, 1) for s in (0, 1, 3))
    assert result.ranks[2].commit_at == (4, 1)
    assert result.spill_bytes == 0


def test_min_chunk_bytes_respected_except_for_a_slots_last_piece():
    """Slots are cut only into pieces >= min_chunk_bytes; small slots and tails may be smaller."""
    # Rooms: 384 KiB, 128 KiB, 384 KiB per iteration.
    prof = profile([(0, 0.75), (1, 0.25), (2, 0.75)], (100 * KiB, 600 * KiB, 50 * KiB, 700 * KiB))
    result = check_plan({0: prof}, EXACT)

    rank = result.ranks[0]
    assert rank.assignments[(1, 0)] == (Chunk(0, 0, 100 * KiB), Chunk(1, 0, 284 * KiB))
    # 128 KiB of room against 316 KiB left of slot 1: no cut, the bubble stays empty.
    assert (1, 1) not in rank.assignments
    assert rank.assignments[(1, 2)] == (Chunk(1, 284 * KiB, 600 * KiB), Chunk(2, 0, 50 * KiB))
    small = [c for chunks in rank.assignments.values() for c in chunks
             if c.nbytes < EXACT.min_chunk_bytes]
    assert small and all(c.stop == prof.slot_bytes[c.slot] for c in small)


def test_interval_accounts_for_rooms_too_small_to_cut():
    """Regression: the interval comes from the real fill, not bytes / capacity.

    600 KiB of state against 300 KiB per iteration looks like two iterations,
    but after the 100 KiB slot the 200 KiB left cannot take a cut of the
    500 KiB slot (min_chunk_bytes 256 KiB), so three are needed and, with
    three, nothing is spilled.
    """
    prof = profile([(0, 600 * KiB / MiB)], (100 * KiB, 500 * KiB))
    result = check_plan({0: prof}, EXACT)

    assert result.interval == 3
    assert result.spill_bytes == 0 and result.predicted_overhead == 0


def test_empty_state_and_zero_byte_slots():
    """Zero-byte slots get no chunks; an empty rank neither spills nor raises the interval."""
    options = PlannerOptions(safety=0.5, per_bubble_seconds=0.0, min_bubble_seconds=0.1,
                             min_chunk_bytes=1)
    empty = profile([], (0, 0))
    sparse = profile([(0, 1.0)], (0, 256 * KiB, 0, 256 * KiB, 0))
    result = check_plan({0: empty, 1: sparse}, options)

    assert result.interval == 1
    assert result.ranks[0].assignments == {} and result.ranks[0].commit_at is None
    assert result.ranks[0].spill_bytes == 0 and result.ranks[0].predicted_overhead == 0
    assert result.ranks[1].assignments[(1, 0)] == (Chunk(1, 0, 256 * KiB),
                                                   Chunk(3, 0, 256 * KiB))
    assert plan({}, options).interval == 1


def _rank_profiles():
    bubble = st.tuples(st.integers(0, 40), st.floats(0.0, 0.02, allow_nan=False))
    return st.builds(
        lambda bubbles, iteration, bandwidth, slots: RankProfile(
            bubbles=tuple(sorted(dict(bubbles).items())), iteration_seconds=iteration,
            copy_bytes_per_second=bandwidth, slot_bytes=tuple(slots)),
        st.lists(bubble, max_size=8),
        st.floats(0.01, 2.0),
        st.sampled_from([1e8, 1e9, 2.5e10]) | st.floats(1e6, 1e10),
        st.lists(st.integers(0, 8 * MiB) | st.sampled_from([0, 1, 4 * KiB]), max_size=6))


_options = st.builds(
    PlannerOptions,
    safety=st.floats(0.05, 1.0),
    per_bubble_seconds=st.sampled_from([0.0, 1e-4, 0.5e-3, 2e-3]),
    min_bubble_seconds=st.sampled_from([0.0, 1e-3, 5e-3]),
    min_chunk_bytes=st.sampled_from([1, 4 * KiB, 256 * KiB, 2 * MiB]),
    max_interval=st.integers(1, 6))


@settings(max_examples=200, deadline=None)
@given(profiles=st.dictionaries(st.integers(0, 1023), _rank_profiles(), min_size=1,
                                max_size=4),
       options=_options)
def test_random_profiles_keep_coverage_and_capacity(profiles, options):
    """Any profile: bubbles within capacity, every byte once in order, minimal shared interval."""
    check_plan(profiles, options)
