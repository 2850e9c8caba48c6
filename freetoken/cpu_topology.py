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


def _allowed_cpus() -> list:
    """Logical CPU ids this process may run on."""
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
