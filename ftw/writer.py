"""Write one FTW file (SPEC.md): plan the layout from the tables, then fill it in parallel.

Owns layout (§5, §6, §7), the header bytes (§3) and the atomic, parallel write. It knows nothing
of Hugging Face: callers hand it TensorEntry/BankEntry objects whose callbacks produce bytes.

    plan = plan_layout(metadata, tensors, banks, split_size)   # every offset, before any data
    write(path, metadata, tensors, banks, threads=8)           # OUT.partial -> pwrite -> fsync -> rename
"""
from __future__ import annotations

import errno
import json
import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional

import numpy as np

from . import constants as C
from .errors import (DiskFullError, FTWError, OutputExistsError, OutputNotWritableError,
                     SplitSizeError)

CRC_PLACEHOLDER = "00000000"
_ZEROS = bytes(C.ALIGNMENT)


@dataclass
class TensorEntry:
    """One non-expert tensor. `read()` yields its bytes (already in `dtype`) in order, in chunks."""
    name: str
    dtype: str
    shape: tuple
    read: Callable[[], Iterable]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * C.DTYPE_SIZES[self.dtype]


@dataclass
class BankEntry:
    """One MoE layer's experts. `read_expert(e)` returns {"gate": [I, D], "up": [I, D], "down": [D, I]}
    C-contiguous numpy arrays whose bytes are already in `dtype` (bf16 as uint16 bits)."""
    layer: int
    dtype: str
    num_experts: int
    inter_size: int   # I
    hidden_size: int  # D
    read_expert: Callable[[int], dict]
    projections: tuple = field(init=False)
    slot_stride: int = field(init=False)

    def __post_init__(self):
        es = C.DTYPE_SIZES[self.dtype]
        shapes = {"gate": (self.inter_size, self.hidden_size), "up": (self.inter_size, self.hidden_size),
                  "down": (self.hidden_size, self.inter_size)}
        projs, pos = [], 0
        for name in C.BANK_PROJECTIONS:  # SPEC.md §5.2 slot layout
            pos = C.round_up(pos, C.PROJ_ALIGNMENT)
            nbytes = shapes[name][0] * shapes[name][1] * es
            projs.append({"name": name, "shape": list(shapes[name]), "offset": pos, "nbytes": nbytes})
            pos += nbytes
        self.projections = tuple(projs)
        self.slot_stride = C.round_up(pos, C.ALIGNMENT)

    @property
    def nbytes(self) -> int:
        return self.num_experts * self.slot_stride


@dataclass
class Plan:
    header: dict          # with placeholder checksums
    header_len: int
    files: list           # [{"name", "data_offset", "data_size"}]
    placed: list          # [(entry, file_index, offset)] in data order


def tensor_sort_key(name: str):
    """Global tensors first, then blk.0.*, blk.1.*, ... (layer compared as an integer) (§7)."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 1 and parts[1].isdigit():
        return (1, int(parts[1]), name)
    return (0, 0, name)


def dumps(obj) -> bytes:
    """Canonical JSON bytes of the header (§3)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def plan_layout(metadata: dict, tensors: list, banks: list, split_size: Optional[int] = None,
                name: str = "model.ftw") -> Plan:
    """Place every entry (§7 order) and build the header with placeholder checksums."""
    entries = sorted(tensors, key=lambda t: tensor_sort_key(t.name)) + sorted(banks, key=lambda b: b.layer)
    names = [t.name for t in tensors]
    if len(set(names)) != len(names) or len({b.layer for b in banks}) != len(banks):
        raise FTWError("internal: duplicate tensor name or bank layer handed to the writer")
    data_offset = C.round_up(C.PREFIX_SIZE + 2, C.ALIGNMENT)
    for _ in range(16):  # the header length depends on the part count, which depends on data_offset
        files, placed = _assign_files(entries, data_offset, split_size, name)
        header = _header(metadata, files, placed)
        header_len = len(dumps(header))
        needed = C.round_up(C.PREFIX_SIZE + header_len, C.ALIGNMENT)
        if needed == data_offset:  # data_offset is exactly round_up(prefix + header) (§3)
            return Plan(header, header_len, files, placed)
        data_offset = needed
    raise FTWError("internal: header layout did not converge")  # pragma: no cover


def _assign_files(entries, data_offset, split_size, name):
    cap = None if split_size is None else split_size - data_offset
    files = [{"name": name, "data_offset": data_offset, "data_size": 0}]
    placed, used = [], 0
    for entry in entries:
        size = C.round_up(entry.nbytes, C.ALIGNMENT)
        if cap is not None and used + size > cap:
            part_cap = split_size - C.PART_PREFIX_SIZE
            if size > part_cap:
                raise SplitSizeError(
                    f"--split-size {split_size} bytes is smaller than {_entry_name(entry)} "
                    f"({size} bytes with its header/alignment); use a --split-size of at least "
                    f"{size + C.PART_PREFIX_SIZE} bytes")
            # a new part (an empty part always has room: size <= part_cap)
            files.append({"name": f"{name}.part{len(files)}", "data_offset": C.PART_PREFIX_SIZE,
                          "data_size": 0})
            used, cap = 0, part_cap
        placed.append((entry, len(files) - 1, used))
        used += size
        files[-1]["data_size"] = used
    return files, placed


def _entry_name(entry) -> str:
    return entry.name if isinstance(entry, TensorEntry) else C.bank_name(entry.layer)


def _header(metadata, files, placed, crcs=None) -> dict:
    tensors, banks = [], []
    for i, (entry, file_index, offset) in enumerate(placed):
        if isinstance(entry, TensorEntry):
            crc = CRC_PLACEHOLDER if crcs is None else f"{crcs[i]:08x}"
            tensors.append({"name": entry.name, "dtype": entry.dtype, "shape": list(entry.shape),
                            "file": file_index, "offset": offset, "nbytes": entry.nbytes, "crc32": crc})
        else:
            slot_crcs = ([CRC_PLACEHOLDER] * entry.num_experts if crcs is None
                         else [f"{c:08x}" for c in crcs[i]])
            banks.append({"layer": entry.layer, "name": C.bank_name(entry.layer), "dtype": entry.dtype,
                          "file": file_index, "offset": offset, "num_experts": entry.num_experts,
                          "slot_stride": entry.slot_stride, "projections": list(entry.projections),
                          "slot_crc32": slot_crcs})
    return {"metadata": metadata, "files": files, "tensors": tensors, "banks": banks}


def write(path: str, metadata: dict, tensors: list, banks: list, *, threads: Optional[int] = None,
          split_size: Optional[int] = None, force: bool = False, progress: bool = False) -> Plan:
    """Write `path` atomically: `path.partial` (+ parts), parallel pwrite, fsync, rename.

    On any error or Ctrl-C no `path` appears and the partial files are removed. Memory stays
    bounded by ~2 x threads jobs (one tensor chunk or one expert slot each).
    """
    path = os.path.abspath(path)
    directory, base = os.path.split(path)
    if os.path.exists(path) and not force:
        raise OutputExistsError(f"{path} exists; pass --force to overwrite it or choose another -o")
    if not os.path.isdir(directory):
        raise OutputNotWritableError(f"output folder {directory} does not exist; create it first")
    plan = plan_layout(metadata, tensors, banks, split_size, base)
    finals = [os.path.join(directory, f["name"]) for f in plan.files]
    partials = [p + ".partial" for p in finals]
    fds = []
    try:
        for p, f in zip(partials, plan.files):
            fds.append(_open_output(p))
            _reserve(fds[-1], f["data_offset"] + f["data_size"], p)
        crcs = _write_data(plan, fds, partials, threads, progress)
        header_bytes = dumps(_header(metadata, plan.files, plan.placed, crcs))
        assert len(header_bytes) == plan.header_len, "fixed-width checksums keep the header length"
        header_crc = zlib.crc32(header_bytes)
        prefix = struct.pack("<4sIQII", C.MAGIC, C.VERSION, len(header_bytes), header_crc, 0)
        _pwrite_all(fds[0], prefix + header_bytes, 0, partials[0])
        for k in range(1, len(fds)):
            part = struct.pack("<4sIIII", C.PART_MAGIC, C.VERSION, k, len(fds), header_crc)
            _pwrite_all(fds[k], part, 0, partials[k])
        for fd, p in zip(fds, partials):
            _fsync(fd, p)
        for k in list(range(1, len(fds))) + [0]:  # main file last: its presence means complete
            os.rename(partials[k], finals[k])
        _fsync_dir(directory)
    except BaseException:
        for fd in fds:
            os.close(fd)
        fds = []
        for p in partials:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        raise
    finally:
        for fd in fds:
            os.close(fd)
    return plan


def _write_data(plan: Plan, fds: list, paths: list, threads: Optional[int], progress: bool) -> list:
    """Run every tensor and slot job on a thread pool; returns crcs aligned with plan.placed."""
    threads = threads or min(8, os.cpu_count() or 1)
    crcs = [None if isinstance(e, TensorEntry) else [0] * e.num_experts for e, _, _ in plan.placed]
    total = sum(e.nbytes for e, _, _ in plan.placed)
    bar = _progress_bar(total) if progress else None
    slots = threading.BoundedSemaphore(2 * threads)
    failed: list = []

    def run(job):
        try:
            if not failed:
                job()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            failed.append(e)
        finally:
            slots.release()

    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ftw-write")
    try:
        for job in _jobs(plan, fds, paths, crcs, bar):
            while not slots.acquire(timeout=0.2):  # short waits keep Ctrl-C responsive
                pass
            if failed:
                slots.release()
                break
            pool.submit(run, job)
        pool.shutdown(wait=True)
    except BaseException:  # Ctrl-C or a job-generator error: no worker may outlive the fds
        failed.append(None)  # stop workers from starting new jobs
        pool.shutdown(wait=True, cancel_futures=True)
        _close_bar(bar, ok=False)
        raise
    errors = [e for e in failed if e is not None]
    _close_bar(bar, ok=not errors)
    if errors:
        raise errors[0]
    return crcs


def _close_bar(bar, ok: bool) -> None:
    if bar is not None:
        bar.leave = ok  # on failure the error line replaces the bar
        bar.close()


def _jobs(plan: Plan, fds: list, paths: list, crcs: list, bar) -> Iterator[Callable]:
    """One job per tensor, one per expert slot, in data order (streams layer by layer)."""
    for i, (entry, file_index, offset) in enumerate(plan.placed):
        f = plan.files[file_index]
        start = f["data_offset"] + offset
        path = paths[file_index]
        if isinstance(entry, TensorEntry):
            yield lambda i=i, entry=entry, start=start, fd=fds[file_index], path=path: \
                _write_tensor(entry, fd, start, path, crcs, i, bar)
        else:
            for e in range(entry.num_experts):
                yield lambda i=i, e=e, entry=entry, start=start, fd=fds[file_index], path=path: \
                    _write_slot(entry, e, fd, start + e * entry.slot_stride, path, crcs, i, bar)


def _write_tensor(entry: TensorEntry, fd: int, start: int, path: str, crcs: list, i: int, bar) -> None:
    crc, pos = 0, 0
    for chunk in entry.read():
        mv = memoryview(chunk).cast("B")
        if pos + len(mv) > entry.nbytes:
            break
        crc = zlib.crc32(mv, crc)
        _pwrite_all(fd, mv, start + pos, path)
        pos += len(mv)
        if bar is not None:
            bar.update(len(mv))
    if pos != entry.nbytes:
        raise FTWError(f"internal: tensor {entry.name} produced a wrong number of bytes "
                       f"(expected {entry.nbytes}); please report this")
    crcs[i] = crc


def _write_slot(entry: BankEntry, e: int, fd: int, start: int, path: str, crcs: list, i: int, bar) -> None:
    arrays = entry.read_expert(e)
    crc, pos = 0, 0
    for proj in entry.projections:  # padding stays zero from the preallocated file (§5.2)
        crc = zlib.crc32(_ZEROS[:proj["offset"] - pos], crc)
        mv = memoryview(np.ascontiguousarray(arrays[proj["name"]])).cast("B")
        if len(mv) != proj["nbytes"]:
            raise FTWError(f"internal: {C.bank_name(entry.layer)} expert {e} {proj['name']} has "
                           f"{len(mv)} bytes, expected {proj['nbytes']}; please report this")
        crc = zlib.crc32(mv, crc)
        _pwrite_all(fd, mv, start + proj["offset"], path)
        pos = proj["offset"] + proj["nbytes"]
    crcs[i][e] = zlib.crc32(_ZEROS[:entry.slot_stride - pos], crc)
    if bar is not None:
        bar.update(entry.slot_stride)


def _progress_bar(total: int):
    from tqdm import tqdm
    # disable=None: no bar when stderr is not a terminal (logs, CI)
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc="convert",
                dynamic_ncols=True, smoothing=0.1, disable=None)


def _open_output(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    except (PermissionError, IsADirectoryError, NotADirectoryError, FileNotFoundError) as e:
        raise OutputNotWritableError(f"cannot create {path} ({e.strerror}); choose a writable -o "
                                     "folder") from None
    except OSError as e:
        _raise_write_error(e, path)


def _reserve(fd: int, size: int, path: str) -> None:
    """Allocate the whole file up front, so a full disk fails at once, not after minutes."""
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except AttributeError:
        pass
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            _raise_write_error(e, path)
    try:
        os.ftruncate(fd, size)
    except OSError as e:
        _raise_write_error(e, path)


def _pwrite_all(fd: int, data, offset: int, path: str) -> None:
    mv = memoryview(data).cast("B")
    done = 0
    while done < len(mv):
        try:
            n = os.pwrite(fd, mv[done:], offset + done)
        except OSError as e:
            _raise_write_error(e, path)
        if n <= 0:
            _raise_write_error(OSError(errno.EIO, "short write"), path)
        done += n


def _fsync(fd: int, path: str) -> None:
    try:
        os.fsync(fd)
    except OSError as e:
        _raise_write_error(e, path)


def _fsync_dir(directory: str) -> None:
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


def _raise_write_error(e: OSError, path: str):
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        raise DiskFullError(f"the disk is full while writing {path}; free some space (the model "
                            "needs about the size of its safetensors) or write elsewhere with -o") from None
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        raise OutputNotWritableError(f"cannot write {path} ({e.strerror}); choose a writable -o folder") from None
    raise FTWError(f"writing {path} failed: {e.strerror or e}") from None


def tensor_from_array(name: str, dtype: str, array: np.ndarray) -> TensorEntry:
    """A TensorEntry over an in-memory array whose bytes are already in `dtype` (tests, tools)."""
    array = np.ascontiguousarray(array)
    if array.itemsize != C.DTYPE_SIZES[dtype]:
        raise FTWError(f"array for {name} has {array.itemsize}-byte elements, not {dtype}")
    return TensorEntry(name, dtype, tuple(array.shape), lambda: [array])


def bank_from_arrays(layer: int, dtype: str, experts: list) -> BankEntry:
    """A BankEntry over in-memory [{"gate", "up", "down"}] arrays (tests, tools)."""
    inter, hidden = experts[0]["gate"].shape
    return BankEntry(layer, dtype, len(experts), inter, hidden, lambda e: experts[e])
