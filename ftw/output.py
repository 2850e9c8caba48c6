"""The writer's output files: create, reserve, write page-aligned blocks, fsync, and the named
errors for a full disk or a refused path. Knows nothing of the layout or of the header.

Blocks go through O_DIRECT where the filesystem allows it: they reach the disk while the
converter is still reading its source, instead of piling up as dirty pages that the final
fsync flushes after all reading is done (on a host with a lot of RAM, nothing is written back
before that fsync). Elsewhere (tmpfs, or a filesystem that refuses a direct write) the same
blocks go through the page cache, and posix_fadvise(DONTNEED) starts their writeback at once.
"""
from __future__ import annotations

import errno
import mmap
import os
import threading

from .errors import DiskFullError, FTWError, OutputNotWritableError

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class OutputFile:
    """One output file of known size, preallocated. Safe to write from several threads."""

    def __init__(self, path: str, size: int, direct: bool = True):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | _CLOEXEC, 0o644)
        except (PermissionError, IsADirectoryError, NotADirectoryError, FileNotFoundError) as e:
            raise OutputNotWritableError(f"cannot create {path} ({e.strerror}); choose a writable -o "
                                         "folder") from None
        except OSError as e:
            raise_write_error(e, path)
        self.direct_fd = None
        self._lock = threading.Lock()
        try:
            _reserve(self.fd, size, path)
            if direct and hasattr(os, "O_DIRECT"):
                try:
                    self.direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT | _CLOEXEC)
                except OSError as e:
                    if e.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT (tmpfs)
                        raise_write_error(e, path)
        except BaseException:
            os.close(self.fd)
            raise

    def write_block(self, block: memoryview, offset: int) -> None:
        """Write `block` at `offset`. For the direct path the caller keeps the block's address,
        length and offset multiples of the 4096 alignment (bytes past the entry are zeros the
        file has anyway, SPEC.md §5)."""
        fd = self.direct_fd
        if fd is not None:
            try:
                _pwrite_raw(fd, block, offset)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:  # a filesystem that opens O_DIRECT but refuses the write
                    raise_write_error(e, self.path)
                self._use_buffered()
        self.write(block, offset)
        try:  # start writeback now rather than at the final fsync (a hint: failure is harmless)
            os.posix_fadvise(self.fd, offset, len(block), os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError):
            pass

    def write(self, data, offset: int) -> None:
        """Buffered write of any bytes at any offset (headers, prefixes)."""
        try:
            _pwrite_raw(self.fd, data, offset)
        except OSError as e:
            raise_write_error(e, self.path)

    def fsync(self) -> None:
        try:
            os.fsync(self.fd)  # one fd per inode is enough; direct writes need it for metadata
        except OSError as e:
            raise_write_error(e, self.path)

    def close(self) -> None:
        self._use_buffered()
        os.close(self.fd)

    def _use_buffered(self) -> None:
        with self._lock:
            if self.direct_fd is not None:
                os.close(self.direct_fd)
                self.direct_fd = None


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Private anonymous, page-aligned, zero-filled memory (what O_DIRECT asks of a user buffer)."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    return mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes)


def fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def raise_write_error(e: OSError, path: str):
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        raise DiskFullError(f"the disk is full while writing {path}; free some space (the model "
                            "needs about the size of its safetensors) or write elsewhere with -o") from None
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        raise OutputNotWritableError(f"cannot write {path} ({e.strerror}); choose a writable -o folder") from None
    raise FTWError(f"writing {path} failed: {e.strerror or e}") from None


def _reserve(fd: int, size: int, path: str) -> None:
    """Allocate the whole file up front, so a full disk fails at once, not after minutes."""
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except AttributeError:
        pass
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise_write_error(e, path)
    try:
        os.ftruncate(fd, size)
    except OSError as e:
        raise_write_error(e, path)


def _pwrite_raw(fd: int, data, offset: int) -> None:
    mv = memoryview(data).cast("B")
    done = 0
    while done < len(mv):
        n = os.pwrite(fd, mv[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n
