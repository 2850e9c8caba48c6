"""Run a command and watch its threads: whether anything else runs on the CPU expert pool's cores
while a benchmark decodes. Samples /proc/PID/task/* every --every seconds (Linux) and prints, for
each thread that used CPU time, its name, the CPUs it was seen on, user and system seconds, and
its voluntary and involuntary context switches (an involuntary switch: something else took the
core). A pool worker that spins between jobs shows few of either; a thread that shares a core
with a busy one shows many involuntary switches.

    python tools/watch_threads.py -- python tools/bench_decode.py --tokens 24 --cache-fracs 0.5

The first process of the command is watched (children of a `timeout` or shell wrapper: pass
--child). What it prints goes through as it is; the table follows it.
"""
import argparse
import os
import subprocess
import sys
import time

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def sample(pid: int) -> dict:
    """tid -> (name, cpu, user ticks, system ticks, voluntary, involuntary) of every thread
    of pid now; {} when it has ended."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        except OSError:  # (the thread ended between the listing and the read)
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()  # field 3 of proc(5) onwards
        out[int(tid)] = (name, int(fields[36]), int(fields[11]), int(fields[12]),
                         int(status["voluntary_ctxt_switches"]),
                         int(status["nonvoluntary_ctxt_switches"]))
    return out


def summarize(samples: list) -> list:
    """Per thread seen in the samples (in order): (tid, name, CPUs seen, user s, system s,
    voluntary, involuntary) over the watch, for threads that used any CPU time."""
    first, last, cpus = {}, {}, {}
    for snap in samples:
        for tid, row in snap.items():
            first.setdefault(tid, row)
            last[tid] = row
            cpus.setdefault(tid, set()).add(row[1])
    rows = []
    for tid in sorted(last):
        a, b = first[tid], last[tid]
        user, system = (b[2] - a[2]) / CLK_TCK, (b[3] - a[3]) / CLK_TCK
        if user + system <= 0:
            continue
        rows.append((tid, b[0], sorted(cpus[tid]), user, system, b[4] - a[4], b[5] - a[5]))
    return rows


def table(rows: list) -> str:
    lines = [f"{'tid':>8} {'name':<16} {'user s':>7} {'sys s':>6} {'vol':>7} {'invol':>6}  cpus seen",
             "-" * 72]
    for tid, name, cpus, user, system, vol, invol in rows:
        seen = ",".join(map(str, cpus[:12])) + (",..." if len(cpus) > 12 else "")
        lines.append(f"{tid:>8} {name[:16]:<16} {user:7.2f} {system:6.2f} {vol:7d} {invol:6d}  {seen}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--every", type=float, default=0.2, help="seconds between samples")
    ap.add_argument("--child", action="store_true",
                    help="watch the command's first child (the command is a wrapper)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("give the command to watch after --")
    if not os.path.isdir("/proc/self/task"):
        raise SystemExit("watch_threads reads /proc/PID/task: Linux only")
    proc = subprocess.Popen(cmd)
    pid, samples = proc.pid, []
    while proc.poll() is None:
        if a.child:
            try:
                with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                    kids = f.read().split()
            except OSError:
                kids = []
            pid = int(kids[0]) if kids else proc.pid
        snap = sample(pid)
        if snap:
            samples.append(snap)
        time.sleep(a.every)
    print(f"\n# watch_threads: pid {pid}, {len(samples)} samples every {a.every:g} s; "
          f"threads that used CPU time (their first to last sample)")
    print(table(summarize(samples)))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
