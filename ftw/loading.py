"""Load expert banks from a validated FTW file into exact-size, page-aligned host buffers.

Owns only the read path (O_DIRECT by several threads, buffered fallback); validation lives in
header.py, and pinning is the caller's `register` callback (ftw never imports torch).
"""
from __future__ import annotations

import errno
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from .errors import FTWError, TruncatedFileError
from .header import BankInfo

LOAD_CHUNK = 8 << 20  # bytes per read; a multiple of the 4096 alignment, so O_DIRECT rules hold


@dataclass
class HostBank:
    """One layer's expert bank in host memory, as load_banks returns it."""
    info: BankInfo
    data: np.ndarray  # uint8 [num_experts * slot_stride], page-aligned, exact size


def alloc_bank(nbytes: int) -> mmap.mmap:
    """Exact-size, page-aligned, zero-filled private anonymous memory.

    MAP_PRIVATE, not Python's default MAP_SHARED (shmem): first touch of a private page costs
    about half the CPU time, and first touch is what a load into fresh memory pays. No
    MADV_HUGEPAGE nor MADV_POPULATE_WRITE: docs/MEASUREMENTS.md#bank-loading.
    """
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    return mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes)


class _Source:
    """One data file opened twice: O_DIRECT (when asked and allowed) and buffered."""

    def __init__(self, path: str, direct: bool):
        self.path = path
        self.buffered_fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.direct_fd = None
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.direct_fd = os.open(path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: the filesystem refuses O_DIRECT (tmpfs)
                    raise
        self.lock = threading.Lock()

    def read_into(self, mv: memoryview, offset: int) -> None:
        fd = self.direct_fd
        if fd is not None:
            try:
                _read_all(fd, mv, offset, self.path)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.use_buffered()
        _read_all(self.buffered_fd, mv, offset, self.path)

    def use_buffered(self) -> None:
        with self.lock:
            if self.direct_fd is not None:
                os.close(self.direct_fd)
                self.direct_fd = None

    def close(self) -> None:
        self.use_buffered()
        os.close(self.buffered_fd)


def _read_all(fd: int, mv: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:]], offset + done)  # releases the GIL; no staging copy
        if n == 0:
            raise TruncatedFileError(f"{path} ended early while loading expert banks; re-copy it")
        done += n


def load_banks(f, threads: Optional[int] = None, direct: bool = True,
               register: Optional[Callable] = None) -> dict:
    """See FTWFile.load_banks (`f` is an ftw.FTWFile). Returns {layer: HostBank} in layer order."""
    threads = threads or min(8, max(4, os.cpu_count() or 1))  # NVMe wants several reads in flight
    banks = sorted(f.banks.values(), key=lambda b: b.layer)
    sources = {}
    out = {}
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ftw-load")
    try:
        for b in banks:
            if b.file not in sources:
                sources[b.file] = _Source(f.paths[b.file], direct)
        pending = []
        for b in banks:
            buf = alloc_bank(b.nbytes)
            data = np.frombuffer(buf, dtype=np.uint8)
            mv = memoryview(buf)
            src = sources[b.file]
            start = f.files[b.file]["data_offset"] + b.offset
            chunks = [(a, min(LOAD_CHUNK, b.nbytes - a)) for a in range(0, b.nbytes, LOAD_CHUNK)]
            futures = [pool.submit(src.read_into, mv[a:a + n], start + a) for a, n in chunks]
            pending.append((b, data, futures))
        for b, data, futures in pending:
            for fut in futures:
                fut.result()
            if register is not None:
                register(data)
            out[b.layer] = HostBank(b, data)
    except OSError as e:
        raise FTWError(f"reading expert banks from {f.path} failed: {e.strerror or e}") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for s in sources.values():
            s.close()
    return out
