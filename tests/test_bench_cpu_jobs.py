"""tools/bench_cpu_jobs.py runs end to end on a tiny shape and prints its one table. The jobs
are timed by a fake clock that moves 10 µs a reading, so the table's times are exact."""
import itertools
import re

import pytest

kernels = pytest.importorskip("freetoken._expert_ffn")


def fake_clock(step_s=10e-6):
    """A clock() that moves step_s seconds each time it is read."""
    ticks = itertools.count()
    return lambda: next(ticks) * step_s


def check_timed_columns(rows, hidden=256, inter=128):
    """Under fake_clock: a job is read three times (before and after submit, after wait), so it
    takes 20 µs, its submit 10 µs, and GB/s is k experts' bytes over 20 µs."""
    from freetoken import bandwidth as bw
    eb = bw.synthetic_layout(bw.ExpertShape(hidden, inter, 8, "bf16", 1, "x")).expert_nbytes
    for r in rows:
        k = int(r[4])
        assert [float(v) for v in r[6:10]] == [20.0, 20.0, 20.0, 10.0], r  # mean, p50, p90, sub
        assert float(r[10]) == pytest.approx(k * eb / 20e-6 / 1e9, abs=0.051), r


def test_bench_cpu_jobs_tiny(capsys):
    import bench_cpu_jobs
    bench_cpu_jobs.main(["--bank-gb", "0.02", "--jobs", "3", "--experts", "2,3", "--gaps-us", "0,50",
                         "--hidden", "256", "--inter", "128", "--threads", "1", "--seconds", "0.1",
                         "--steady-gb", "0.01"], clock=fake_clock())
    text = capsys.readouterr().out
    rows = [line.split() for line in text.splitlines() if re.match(r"^\s+0\.0\s+(no|yes)\s", line)]
    assert len(rows) == 2 * 2 * 2  # huge pages no/yes x k x gap
    assert {r[3] for r in rows} == {"default"}
    assert {r[4] for r in rows} == {"2", "3"}
    check_timed_columns(rows)
    assert "steady state" in text and "STREAM read" in text


def test_bench_cpu_jobs_tunings(capsys):
    """--tunings: every row under each tuning, on one bank; --huge yes: huge-page banks only."""
    import bench_cpu_jobs
    from freetoken import kernels
    bench_cpu_jobs.main(["--bank-gb", "0.02", "--jobs", "3", "--experts", "2", "--gaps-us", "0",
                         "--hidden", "256", "--inter", "128", "--threads", "1", "--seconds", "0.1",
                         "--steady-gb", "0.01", "--huge", "yes",
                         "--tunings", "default;prefetch=0;item_kb=8,prefetch_hint=t0"],
                        clock=fake_clock())
    text = capsys.readouterr().out
    rows = [line.split() for line in text.splitlines() if re.match(r"^\s+0\.0\s+(no|yes)\s", line)]
    assert [(r[1], r[3]) for r in rows] == [("yes", "default"), ("yes", "prefetch=0"),
                                            ("yes", "item_kb=8,prefetch_hint=t0")]
    check_timed_columns(rows)
    assert kernels.get_pool(1).tuning.prefetch == -1  # the pool's own tuning back after the sweep


def test_bench_cpu_jobs_trace_table(capsys):
    import bench_cpu_jobs
    bench_cpu_jobs.main(["--trace", "--bank-gb", "0.02", "--jobs", "3", "--experts", "1,3", "--gaps-us", "0",
                         "--hidden", "256", "--inter", "128", "--threads", "1", "--seconds", "0.1",
                         "--steady-gb", "0.01"])
    text = capsys.readouterr().out
    rows = [line.split() for line in text.splitlines() if re.match(r"^\s+0\.0\s+[13]\s", line)]
    assert [r[1] for r in rows] == ["1", "3"]
    for r in rows:  # job µs, ideal, wake ..., busy share in [0, 1] (printed to 0.01: a job
        # preempted on a loaded machine takes ms, its share then prints 0.00)
        assert float(r[3]) > 0 and float(r[4]) > 0 and 0 <= float(r[12]) <= 1.0


def test_bench_cpu_jobs_gap_wait_spin(capsys, monkeypatch):
    """--gap-wait spin idles between jobs in the native pause loop (as the decode server waits),
    not in time.sleep; the header says which."""
    import time

    import bench_cpu_jobs
    from freetoken import kernels as fk
    spun, slept = [], []
    real = fk.spin_pause_us
    monkeypatch.setattr(fk, "spin_pause_us", lambda us: (spun.append(us), real(us)))
    monkeypatch.setattr(time, "sleep", lambda s: slept.append(s))
    bench_cpu_jobs.main(["--trace", "--gap-wait", "spin", "--bank-gb", "0.02", "--jobs", "3",
                         "--experts", "1", "--gaps-us", "40", "--hidden", "256", "--inter", "128",
                         "--threads", "1", "--seconds", "0.1", "--steady-gb", "0.01"])
    text = capsys.readouterr().out
    assert "idle µs before each job (spin)" in text
    assert spun == [40.0] * (3 + bench_cpu_jobs.WARMUP_JOBS) and 40e-6 not in slept


def test_spin_pause_us_spins_at_least_that_long():
    """The native spin ends on CLOCK_MONOTONIC, which time.monotonic_ns reads too: read before
    and after, the spin took at least its µs on any machine (how much longer depends on the
    machine's load, so that is not asserted)."""
    import time

    from freetoken import kernels as fk
    assert time.get_clock_info("monotonic").implementation == "clock_gettime(CLOCK_MONOTONIC)"
    t = time.monotonic_ns()
    fk.spin_pause_us(20_000)
    assert time.monotonic_ns() - t >= 20_000_000


def test_bench_cpu_jobs_page_kinds(monkeypatch):
    """--huge takes a list of page kinds; an unknown one, or 1 GiB pages none of which are
    reserved, stops with the fix in the message."""
    import bench_cpu_jobs
    import bench_host_banks
    args = ["--bank-gb", "0.02", "--jobs", "1", "--experts", "1", "--gaps-us", "0", "--hidden", "256",
            "--inter", "128", "--threads", "1", "--seconds", "0.05", "--steady-gb", "0.01"]
    with pytest.raises(SystemExit, match="unknown page kind 'x'; use no, yes, 1g or both"):
        bench_cpu_jobs.main(args + ["--huge", "no,x"])

    def no_pages(*a, **k):
        raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(bench_host_banks.mmap, "mmap", no_pages)
    with pytest.raises(RuntimeError, match="Reserve them first, as root: echo 1 > .*nr_hugepages"):
        bench_host_banks.hugetlb_map(20 << 20)
