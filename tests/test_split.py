"""MissSplit (freetoken/experts/split.py): the least-time split of a decode step's misses and
the admissions behind it, against hand-worked cases of its time model."""
from dataclasses import replace

import pytest

from freetoken.experts.policy import split as qstar_split
from freetoken.experts.split import MissBandwidths, MissSplit

SLOT = 9_437_184  # bytes: one Qwen3-30B-A3B expert (µs per slot = SLOT / 1e3 / GB/s)
H200_ZC = MissBandwidths(P=38.6, C=81.3, P_alone=47.5, C_alone=117.0)


def us(gbps):
    return SLOT / 1e3 / gbps


@pytest.mark.parametrize("m", range(0, 9))
def test_offload_and_cpu_fill_all_and_none(m):
    for policy, q in (("offload", m), ("cpu", 0)):
        s = MissSplit(policy, H200_ZC, SLOT)
        assert s.decide(m) == (q, 0)


@pytest.mark.parametrize("m", range(1, 9))
def test_equal_paths_split_in_halves_rounding_up(m):
    """P = C, alone = concurrent: the least phase is at m/2; ties (odd m) go to the larger q,
    which is the paper's q* = round(m * P / (P + C)) with halves up."""
    s = MissSplit("hybrid", MissBandwidths(10.0, 10.0, 10.0, 10.0), SLOT, window_us=0,
                  rule="least_time")
    assert s.decide(m)[0] == qstar_split(m, 10.0, 10.0, "hybrid") == (m + 1) // 2


def test_q_is_the_least_phase_over_every_integer():
    s = MissSplit("hybrid", H200_ZC, SLOT, window_us=0, rule="least_time")
    for m in range(1, 9):
        q, _ = s.decide(m)
        assert all(s.phase(m, q, 0.0) <= s.phase(m, x, 0.0) + 1e-9 for x in range(m + 1))


def test_phase_model_by_hand():
    s = MissSplit("hybrid", H200_ZC, SLOT)
    assert s.phase(1, 1, 0.0) == pytest.approx(us(47.5))  # fill alone
    assert s.phase(1, 0, 0.0) == pytest.approx(us(117.0))  # CPU alone
    # 7 misses, 2 filled: both run; the fills end first, the CPU reads on alone
    fills, cpu_both = 2 * us(38.6), 5 * us(81.3)
    assert fills < cpu_both
    assert s.phase(7, 2, 0.0) == pytest.approx(fills + (cpu_both - fills) * 81.3 / 117.0)
    # 6 misses, 2 filled: the fills are the longer path
    assert s.phase(6, 2, 0.0) == pytest.approx(max(2 * us(38.6), 4 * us(81.3)))
    # q = 0 with 100 µs of earlier copies queued: the CPU reads at the concurrent rate meanwhile
    assert s.phase(2, 0, 100.0) == pytest.approx(100.0 + (2 * us(81.3) - 100.0) * 81.3 / 117.0)


def test_one_miss_runs_on_the_cpu_and_is_admitted_behind():
    """m = 1: the CPU alone (81 µs) beats a fill (199 µs), so q = 0; the copy (199 µs) fits in
    a 200 µs window after the phase, so the expert is admitted for later tokens."""
    s = MissSplit("hybrid", H200_ZC, SLOT, window_us=200.0, rule="least_time")
    assert s.decide(1) == (0, 1)
    assert s.decide(7) == (2, 1)  # 552 µs against 559 (q = 1) and 565 (q = 0)
    assert MissSplit("hybrid", H200_ZC, SLOT, window_us=450.0, rule="least_time").decide(3) == (0, 2)
    no_room = MissSplit("hybrid", H200_ZC, SLOT, window_us=150.0, rule="least_time")
    assert no_room.decide(1) == (0, 0)
    off = MissSplit("hybrid", H200_ZC, SLOT, window_us=200.0, admit=False, rule="least_time")
    assert off.decide(1) == (0, 0)


def test_backlog_drains_and_steers_the_next_steps():
    s = MissSplit("hybrid", H200_ZC, SLOT, window_us=200.0, rule="least_time")
    q, b = s.decide(2)
    s.advance(2, q, b)  # copies that end within the window leave no backlog
    assert s.backlog == 0.0
    s.advance(1, 0, 3)  # three admissions: more than one window drains
    assert s.backlog == pytest.approx(3 * us(47.5) - 200.0)
    assert s.decide(1) == (0, 0)  # no room behind the backlog
    assert s.phase(1, 0, s.backlog) > s.phase(1, 0, 0.0)  # the CPU reads beside the copies
    for _ in range(3):
        s.advance(0, 0, 0)  # steps without misses: each window drains the link
    assert s.backlog == 0.0


def test_fixed_fill_behind_and_capacity_clamps():
    s = MissSplit("cpu", H200_ZC, SLOT, behind=2)
    assert s.decide(5) == (0, 2) and s.decide(1) == (0, 1)
    h = MissSplit("hybrid", H200_ZC, SLOT, window_us=200.0, rule="least_time")
    q, b = h.decide(6)
    assert h.decide(6, capacity_left=1) == (min(q, 1), 0 if q >= 1 else min(b, 1))
    assert h.decide(6, capacity_left=0) == (0, 0)


def test_fixed_fill_behind_only_in_steps_that_fill_nothing():
    """behind_idle (extra fill_behind_idle): the N admissions only where q = 0."""
    s = MissSplit("hybrid", H200_ZC, SLOT, behind=1, behind_idle=True)
    always = MissSplit("hybrid", H200_ZC, SLOT, behind=1)
    for m in range(9):
        q, b = s.decide(m)
        assert q == always.decide(m)[0]
        assert b == (min(1, m) if q == 0 else 0)
    assert s.decide(1) == (0, 1) and s.decide(3)[1] == 0
    assert "in steps that fill nothing" in s.describe()


def test_the_default_is_the_papers_qstar_without_admissions():
    s = MissSplit("hybrid", H200_ZC, SLOT)
    assert [s.decide(m) for m in range(9)] == [(qstar_split(m, 38.6, 81.3, "hybrid"), 0)
                                              for m in range(9)]


def test_tables_are_decide_for_every_miss_count():
    s = MissSplit("hybrid", H200_ZC, SLOT, window_us=200.0, rule="least_time")
    qt, bt = s.tables(8)
    assert [(qt[m], bt[m]) for m in range(9)] == [s.decide(m) for m in range(9)]


def test_unknown_policy_and_rule():
    with pytest.raises(ValueError, match="unknown policy"):
        MissSplit("paper", H200_ZC, SLOT)
    with pytest.raises(ValueError, match="unknown split rule"):
        MissSplit("hybrid", H200_ZC, SLOT, rule="fastest")


def test_observed_rates_steer_the_split():
    """observe(): running means of the paths' rates; the split follows them once P / (P + C)
    moves by 0.01, and the profile's pair is kept for the record."""
    s = MissSplit("hybrid", H200_ZC, SLOT)
    assert s.decide(6)[0] == qstar_split(6, 38.6, 81.3, "hybrid") == 2
    s.observe(2 * SLOT, 2 * us(20.0), 4 * SLOT, 4 * us(100.0))  # a slow link, a fast CPU
    assert s.observed == pytest.approx((20.0, 100.0)) and s.observations == 1
    assert s.decide(6)[0] == qstar_split(6, 20.0, 100.0, "hybrid") == 1
    s.observe(2 * SLOT, 2 * us(120.0), 4 * SLOT, 4 * us(40.0), weight=1.0)  # the reverse
    assert s.observed == pytest.approx((120.0, 40.0))
    assert s.decide(6)[0] == qstar_split(6, 120.0, 40.0, "hybrid") == 5
    assert s.profiled == H200_ZC and "observed P=120.0" in s.observed_info()
    s.observe(0, 1.0, SLOT, 1.0)  # nothing filled: not an observation of both paths
    assert s.observations == 2


@pytest.mark.parametrize("m", range(0, 9))
def test_ceil_rule_fills_at_least_one_and_at_most_one_more_than_qstar(m):
    s = MissSplit("hybrid", H200_ZC, SLOT, rule="ceil")
    q = s.decide(m)[0]
    q_star = qstar_split(m, H200_ZC.P, H200_ZC.C, "hybrid")
    assert q == -(-m * H200_ZC.P // (H200_ZC.P + H200_ZC.C))  # ceil
    assert q_star <= q <= q_star + 1 and (q >= 1 or m == 0) and q <= m
    assert s.decide(m, capacity_left=0)[0] == 0


def test_fixed_fill_behind_only_in_steps_of_few_misses():
    """behind_max_misses (extra fill_behind_max_misses, the cuda default's cap): the N
    admissions only in steps of at most that many misses; q is unchanged."""
    s = MissSplit("hybrid", H200_ZC, SLOT, behind=1, behind_max_misses=4)
    always = MissSplit("hybrid", H200_ZC, SLOT, behind=1)
    for m in range(9):
        q, b = s.decide(m)
        assert q == always.decide(m)[0]
        assert b == (min(1, m - q) if m <= 4 or q == 0 else 0)
    assert s.decide(1) == (0, 1) and s.decide(5)[1] == 0
    # a step that fills nothing admits whatever its misses: a split that never fills at m = K
    # (least_time with a CPU far faster than the link) still warms a cold cache
    fast_cpu = MissSplit("hybrid", replace(H200_ZC, C_alone=40 * H200_ZC.P_alone), SLOT, behind=1,
                         behind_max_misses=4, rule="least_time")
    assert fast_cpu.decide(8) == (0, 1)
    assert "in steps of <= 4 misses" in s.describe()
    assert "admissions off" in MissSplit("hybrid", H200_ZC, SLOT, behind=0).describe()
