"""What a GPU-controlled decode step's CPU jobs cost, from the serve tables' counters
(cython/serve.h; freetoken/kernels.py ServeTable.job_times / trace_times): pure summaries for
describe() lines and the benches. Knows nothing of the native module; kernels re-exports both.
"""


def job_summary(times: list) -> dict:
    """Several tables' job_times() as one: `jobs`, `prep_us` (mean µs from ready seen to the
    submit), ready-to-done percentiles `p50`, `p90`, `p99` (µs: their bucket's upper edge) and
    `over`, the jobs longer than the last bucket's start `over_us`."""
    prep = sum(t[0] for t in times)
    hist = [sum(c) for c in zip(*(t[1] for t in times))]
    width = times[0][2] if times else 1
    n = sum(hist)
    out = {"jobs": n, "prep_us": prep / max(n, 1) / 1e3, "over": hist[-1] if hist else 0,
           "over_us": width * (len(hist) - 1)}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        seen, at = 0, 0
        for at, count in enumerate(hist):
            seen += count
            if seen >= q * n:
                break
        out[name] = width * (at + 1) if n else 0
    return out


def trace_summary(times: list) -> dict:
    """Several tables' trace_times() as means per traced job, in µs unless named: `jobs`,
    `job` (submit to done), `wake` and `wake_max` (the workers' first claims after the submit:
    their mean, the latest), `dwait` (a worker's D items' waits for the G items), `spread` (of
    the workers' last ends), `signal` (the last end to done), `g_gbs`, `d_gbs` (GB/s per
    worker while running G and D items). Empty without traced jobs."""
    s = {k: sum(t[k] for t in times) for k in (times[0] if times else {})}
    n = s.get("jobs", 0)
    if not n:
        return {}
    out = {"jobs": n}
    for key in ("job", "wake", "wake_max", "dwait", "spread", "signal"):
        out[key] = s[key + "_ns"] / n / 1e3
    for key in ("g", "d"):
        out[key + "_gbs"] = s[key + "_bytes"] / max(s[key + "_busy_ns"], 1)
    return out
