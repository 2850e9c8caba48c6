"""Smoke tests of the machine-level benches in tools/: the CPU expert kernel
(bench_cpu_experts.py), the zero-copy gather (bench_gather.py), PCIe reads of hot and cold
experts (bench_hot_reads.py) and the thread watcher (watch_threads.py). The cuda ones are marked
`gpu`; without cuda each says so and exits."""
import os

import pytest
import torch


def test_bench_cpu_experts_beside_copies_says_it_needs_cuda(monkeypatch, capsys):
    import bench_cpu_experts
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["bench_cpu_experts.py", "--beside-copies", "--threads", "1"])
    with pytest.raises(SystemExit) as e:
        bench_cpu_experts.main()
    assert "needs a CUDA GPU" in str(e.value)


@pytest.mark.gpu
def test_bench_cpu_experts_beside_copies_cuda(monkeypatch, capsys):
    import bench_cpu_experts
    monkeypatch.setattr("sys.argv", ["bench_cpu_experts.py", "--beside-copies", "--shapes", "qwen3",
                                     "--seconds", "0.3", "--variants", "default;prefetch=0"])
    bench_cpu_experts.main()
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith("Qwen3-30B-A3B ")]
    assert len(rows) == 6  # the STREAM bound and two tunings, printed as they finish and again in the table
    assert all(float(v) > 0 for r in rows for v in r[-4:])


def test_bench_cpu_experts_call_sizes_fit_a_fixed_cost(monkeypatch, capsys):
    import bench_cpu_experts
    from freetoken import profile as prof
    monkeypatch.setitem(bench_cpu_experts.SHAPES, "tiny", prof.ExpertShape(256, 128, 8, "bf16", 16, "tiny"))
    monkeypatch.setattr("sys.argv", ["bench_cpu_experts.py", "--shapes", "tiny", "--threads", "1",
                                     "--seconds", "0.05", "--call-experts", "1,2,4"])
    bench_cpu_experts.main()
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("tiny ")]
    assert [r[1] for r in rows[-3:]] == ["1", "2", "4"] and all(float(r[3]) > 0 for r in rows)
    assert "# tiny: ms/call = " in out and "per added expert" in out


def test_bench_cpu_experts_says_when_its_bank_crowds_the_routes():
    """A bank with fewer experts than the model puts more of a batch's routes on each expert:
    the bench prints routes per expert here and in the model."""
    import bench_cpu_experts as b
    ds = b.SHAPES["deepseek"]
    assert b.model_distinct(256, 1, 8) == pytest.approx(8.0)
    assert b.model_distinct(256, 16, 8) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 16))
    note = b.crowding_note(ds, 68, [1, 16])
    assert "holds 68 of the model's 256 experts" in note
    assert "batch 1 1.00 (1.00)" in note and "batch 16 2.18 (1.26)" in note


def test_bench_gather_says_it_needs_cuda(monkeypatch, capsys):
    import bench_gather
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_gather.main(["--programs", "2", "--reps", "1"]) == 2
    assert "needs cuda and Triton" in capsys.readouterr().err


@pytest.mark.gpu
def test_bench_gather_cuda(capsys):
    """One small row: a background gather of 2 programs and a full gather beside it."""
    import bench_gather
    from freetoken.experts.transfer import zero_copy
    if not zero_copy.available():
        pytest.skip("no Triton")
    assert bench_gather.main(["--programs", "2", "--slot-mb", "1", "--bank-gb", "0.01",
                              "--reps", "3"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["2"]]
    assert len(rows) == 1 and float(rows[0][2]) > 0 and float(rows[0][4]) > 0


def test_bench_hot_reads_says_it_needs_cuda(monkeypatch, capsys):
    import bench_hot_reads
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_hot_reads.main(["--jobs", "2"]) == 2
    assert "needs cuda and Triton" in capsys.readouterr().err


@pytest.mark.gpu
def test_bench_hot_reads_cuda(capsys):
    """A small run: every row of the table, with times."""
    import bench_hot_reads
    from freetoken.experts.transfer import zero_copy
    if not zero_copy.available():
        pytest.skip("no Triton")
    assert bench_hot_reads.main(["--bank-gb", "0.2", "--jobs", "6", "--rounds", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith(("-", "gather", "copy"))][1:]
    assert len(rows) == 7 + 4, out
    assert all(float(line.split()[-1]) > 0 for line in rows[1:]), out


def test_watch_threads_reports_the_busy_threads(capsys, monkeypatch, tmp_path):
    """tools/watch_threads.py: a command with a thread that spins shows that thread with its CPU
    time (first to last sample); a sleeping process's idle threads are left out. The spinner
    spins until the watcher's own samples have seen it use 0.35 s of CPU (the sampler then
    writes the file it waits for), so the table holds at least that however loaded the machine
    is; a watcher that never sees it gives up after 3000 samples, and the test fails."""
    import sys

    import watch_threads
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("Linux /proc only")
    seen = tmp_path / "seen"
    spin = ("import os, sys, threading\n"
            "def spin():\n"
            "    while not os.path.exists(sys.argv[1]):\n"
            "        for _ in range(10000): pass\n"
            "th = threading.Thread(target=spin, name='spinner'); th.start(); th.join()\n")
    real, first, calls = watch_threads.sample, {}, []

    def sample(pid):  # the real sample, and the file once a thread has used 0.35 s since first seen
        snap = real(pid)
        calls.append(pid)
        for tid, row in snap.items():
            first.setdefault(tid, row[2] + row[3])
            if (row[2] + row[3] - first[tid]) / watch_threads.CLK_TCK >= 0.35 or len(calls) > 3000:
                seen.touch()
        return snap
    monkeypatch.setattr(watch_threads, "sample", sample)
    rc = watch_threads.main(["--every", "0.02", "--", sys.executable, "-c", spin, str(seen)])
    out = capsys.readouterr().out
    assert rc == 0 and "watch_threads: pid" in out
    assert len(calls) <= 3000 and set(calls) == {int(out.split("watch_threads: pid ")[1].split(",")[0])}
    rows = watch_threads.summarize([{1: ("a", 0, 0, 0, 0, 0), 2: ("b", 1, 5, 0, 1, 0)},
                                    {1: ("a", 0, 0, 0, 0, 0), 2: ("b", 3, 105, 0, 2, 4)}])
    assert rows == [(2, "b", [1, 3], 100 / watch_threads.CLK_TCK, 0.0, 1, 4)]
    body = out.split("-" * 72 + "\n", 1)[1]
    busy = [line.split() for line in body.splitlines() if line.strip()]
    assert busy and max(float(r[2]) + float(r[3]) for r in busy) >= 0.34, out  # (two printed .2f columns summed)


def test_watch_threads_passes_the_exit_code_on(capsys):
    import sys

    import watch_threads
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("Linux /proc only")
    assert watch_threads.main(["--every", "0.01", "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3
