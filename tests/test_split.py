"""The split of a decode step's misses (freetoken/experts/split.py): the paper's q* for hybrid,
all or nothing for offload and cpu, fixed admissions behind it, the capacity clamps."""
import pytest

from freetoken.experts.split import MissBandwidths, MissSplit, default_rates, qstar

H200_ZC = MissBandwidths(P=38.6, C=81.3, P_alone=47.5, C_alone=117.0)


@pytest.mark.parametrize("m", range(0, 9))
def test_offload_and_cpu_fill_all_and_none(m):
    for policy, q in (("offload", m), ("cpu", 0)):
        assert MissSplit(policy, H200_ZC).decide(m) == (q, 0)


@pytest.mark.parametrize("m", range(1, 9))
def test_equal_paths_split_in_halves_rounding_up(m):
    """P = C: q* = round(m / 2) with halves up."""
    s = MissSplit("hybrid", MissBandwidths(10.0, 10.0, 10.0, 10.0))
    assert s.decide(m)[0] == qstar(m, 10.0, 10.0, "hybrid") == (m + 1) // 2


def test_qstar_by_hand():
    """q* = floor(m P / (P + C) + 1/2), clamped to [0, m] and to the free slots; P + C = 0 fills
    nothing; an unknown policy is refused."""
    assert [qstar(m, 38.6, 81.3, "hybrid") for m in range(9)] == [0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert qstar(8, 1.0, 0.0, "hybrid") == 8 and qstar(8, 0.0, 0.0, "hybrid") == 0
    assert qstar(8, 38.6, 81.3, "hybrid", free_slots=1) == 1
    assert qstar(8, 38.6, 81.3, "offload", free_slots=-3) == 0
    with pytest.raises(ValueError, match="unknown policy"):
        qstar(1, 1.0, 1.0, "paper")


def test_the_default_is_the_papers_qstar_without_admissions():
    s = MissSplit("hybrid", H200_ZC)
    assert [s.decide(m) for m in range(9)] == [(qstar(m, 38.6, 81.3, "hybrid"), 0)
                                              for m in range(9)]
    assert "admissions off" in s.describe() and "P=38.6/47.5" in s.describe()


def test_fixed_fill_behind_and_capacity_clamps():
    s = MissSplit("cpu", H200_ZC, behind=2)
    assert s.decide(5) == (0, 2) and s.decide(1) == (0, 1) and s.decide(0) == (0, 0)
    h = MissSplit("hybrid", H200_ZC, behind=2)
    assert h.decide(6) == (2, 2)
    assert h.decide(6, capacity_left=3) == (2, 1)
    assert h.decide(6, capacity_left=1) == (1, 0)
    assert h.decide(6, capacity_left=0) == (0, 0)


def test_tables_are_decide_for_every_miss_count():
    s = MissSplit("hybrid", H200_ZC, behind=1, behind_max_misses=3)
    qt, bt = s.tables(8)
    assert [(qt[m], bt[m]) for m in range(9)] == [s.decide(m) for m in range(9)]


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown policy"):
        MissSplit("paper", H200_ZC)


def test_fixed_fill_behind_only_in_steps_of_few_misses():
    """behind_max_misses (Tuning.fill_behind_max_misses, the cuda default's cap): the N
    admissions only in steps of at most that many misses, or that fill nothing; q unchanged."""
    s = MissSplit("hybrid", H200_ZC, behind=1, behind_max_misses=4)
    always = MissSplit("hybrid", H200_ZC, behind=1)
    for m in range(9):
        q, b = s.decide(m)
        assert q == always.decide(m)[0]
        assert b == (min(1, m - q) if m <= 4 or q == 0 else 0)
    assert s.decide(1) == (0, 1) and s.decide(5)[1] == 0
    # a step that fills nothing admits whatever its misses (a slow link never fills at m = 8)
    slow_link = MissSplit("hybrid", MissBandwidths(1.0, 100.0, 1.0, 100.0), behind=1,
                          behind_max_misses=4)
    assert slow_link.decide(8) == (0, 1)
    assert "in steps of <= 4 misses" in s.describe()
    assert "admissions off" in MissSplit("hybrid", H200_ZC, behind=0).describe()


def test_default_rates_by_device():
    """Without a stored profile: a PCIe 4.0 link against a desktop CPU on cuda (q* = m/3), equal
    paths on the cpu device."""
    assert default_rates("cuda").miss == MissBandwidths(25.0, 50.0, 25.0, 50.0)
    assert default_rates("cpu").miss.P == default_rates("cpu").miss.C
    assert not default_rates("cuda").measured
