"""This process's CPUs: the allowed set, one logical CPU per physical core, the default worker
count and the CPU each pool worker is pinned to.

Pure Python (sched_getaffinity and sysfs); imports no compiled module. freetoken/kernels.py
re-exports physical_cores and default_num_threads.
"""
import os


def _read_int(path):
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


# the allowed CPUs from before keep_off_cores() moved this thread: what pools plan on until
# restore_cores()
_unconfined = None


def _allowed_cpus() -> list:
    """Logical CPU ids this process may run on."""
    if _unconfined is not None:
        return list(_unconfined)
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        list(range(os.cpu_count() or 1))


def physical_cores() -> list:
    """One logical CPU id (the lowest) per physical core in this process's allowed CPU set."""
    first = {}
    for cpu in _allowed_cpus():
        topo = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        key = (_read_int(f"{topo}/physical_package_id"), _read_int(f"{topo}/die_id"),
               _read_int(f"{topo}/core_id"))
        first.setdefault(key if key[2] is not None else ("cpu", cpu), cpu)
    return sorted(first.values())


def default_num_threads(has_gpu: bool = True) -> int:
    """Physical cores minus one driver core with a GPU; all physical cores without (at least 1)."""
    n = len(physical_cores())
    return max(1, n - 1) if has_gpu else n


def _pin_plan(num_threads: int) -> list:
    """CPU per worker: physical cores after the first (left to the driver), then the first,
    then the remaining logical CPUs (SMT siblings); -1 (unpinned) past the allowed set."""
    cores = physical_cores()
    allowed = _allowed_cpus()
    order = cores[1:] + cores[:1] + [c for c in allowed if c not in cores]
    return [order[i] if i < len(order) else -1 for i in range(num_threads)]


def keep_off_cores(cores) -> dict:
    """Move every thread of this process but those pinned to one of `cores` (the pool's
    workers) onto the allowed CPUs outside `cores`, so that nothing else runs where the workers
    wait for their next job; threads started later inherit their starter's CPUs. Returns
    {thread id: its CPUs before} for restore_cores; {} where no CPU would be left, or on a
    system without per-thread affinity."""
    global _unconfined
    cores = set(cores)
    allowed = set(_allowed_cpus())
    free = allowed - cores
    if not cores or not free or not hasattr(os, "sched_setaffinity") \
            or not os.path.isdir("/proc/self/task"):
        return {}
    moved = {}
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            before = os.sched_getaffinity(tid)
            if len(before) == 1 and before <= cores:
                continue  # a pool worker, pinned
            os.sched_setaffinity(tid, free)
            moved[tid] = before
        except OSError:  # (the thread ended meanwhile)
            continue
    if moved and _unconfined is None:
        _unconfined = sorted(allowed)
    return moved


def restore_cores(moved: dict) -> None:
    """Undo keep_off_cores (threads that have ended since are skipped)."""
    global _unconfined
    for tid, cpus in moved.items():
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass
    _unconfined = None
