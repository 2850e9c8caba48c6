"""What the OS says the engine may take of host memory: MemAvailable, a container's memory
cgroup, free pages (os.sysconf, where /proc is missing) and the locked-memory limit. Readers
only, stdlib only (no psutil); the memory plan (memory_plan.py) decides with them. Each reader
returns None where the OS says nothing (tests replace them to simulate small machines).
"""
import os
import resource
from typing import Optional


def read_mem_available() -> Optional[int]:
    """/proc/meminfo MemAvailable in bytes (free + reclaimable; a WSL VM's own), None where
    there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def read_cgroup_room(root: str = "/sys/fs/cgroup") -> Optional[int]:
    """Bytes the container's memory cgroup still allows: limit - (usage - inactive page cache,
    which the kernel reclaims inside the cgroup: a model file just read must not count); cgroup
    v2, else v1. None without a limit (MemAvailable shows the host's inside a container)."""
    for limit_name, usage_name, stat_name, inactive_key in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
             "memory/memory.stat", "total_inactive_file")):
        try:
            with open(os.path.join(root, limit_name)) as f:
                limit = f.read().strip()
            with open(os.path.join(root, usage_name)) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None
        return max(0, int(limit) - usage + _stat(os.path.join(root, stat_name), inactive_key))
    return None


def _stat(path: str, key: str) -> int:
    """A value of a cgroup memory.stat file, 0 when absent."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def read_free_pages() -> Optional[int]:
    """os.sysconf's free physical memory (no page cache: the fallback without /proc)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def read_memlock() -> Optional[int]:
    """RLIMIT_MEMLOCK's soft limit in bytes, None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def host_available() -> tuple:
    """(bytes of host RAM the engine may still take, where the figure comes from): the least
    of MemAvailable and the cgroup's room; os.sysconf's free pages where neither is known."""
    found = [(n, src) for n, src in ((read_mem_available(), "MemAvailable"),
                                      (read_cgroup_room(), "the container's memory limit"))
             if n is not None]
    if not found:
        free = read_free_pages()
        return (free, "free pages") if free is not None else (1 << 62, "unknown")
    return min(found)
