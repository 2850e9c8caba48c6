"""Write one FTW file (SPEC.md): plan the layout, then fill it in parallel, atomically.

Owns the write pipeline: one job per tensor and per expert slot, each assembled in a per-thread
page-aligned buffer and written with one aligned write (output.py: O_DIRECT where allowed),
source reads announced ahead (prefetch hooks), checksums, header last, fsync, rename. Layout
and header JSON live in layout.py; it knows nothing of Hugging Face.

    write(path, metadata, tensors, banks, threads=8)   # OUT.partial -> pwrite -> fsync -> rename
"""
from __future__ import annotations

import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Optional

import numpy as np

from . import constants as C
from .errors import FTWError, OutputExistsError, OutputNotWritableError
from .layout import (BankEntry, Plan, TensorEntry, bank_from_arrays, build_header, dumps,  # noqa: F401
                     plan_layout, tensor_from_array, tensor_sort_key)
from .output import OutputFile, aligned_buffer, fsync_dir

TENSOR_STAGE = 8 << 20     # bytes per tensor write (a multiple of ALIGNMENT)
PREFETCH_AHEAD = 256 << 20  # source bytes announced beyond the jobs already handed to the pool


def write(path: str, metadata: dict, tensors: list, banks: list, *, threads: Optional[int] = None,
          split_size: Optional[int] = None, force: bool = False, progress: bool = False,
          direct: bool = True) -> Plan:
    """Write `path` atomically: `path.partial` (+ parts), parallel aligned writes, fsync, rename.

    On any error or Ctrl-C no `path` appears and the partial files are removed. Memory stays
    bounded by `threads` slot-sized buffers plus ~2 x threads queued jobs. `direct=False` keeps
    every write in the page cache (the same bytes either way).
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
    outs = []
    try:
        for p, f in zip(partials, plan.files):
            outs.append(OutputFile(p, f["data_offset"] + f["data_size"], direct=direct))
        crcs = _write_data(plan, outs, threads, progress)
        header_bytes = dumps(build_header(metadata, plan.files, plan.placed, crcs))
        assert len(header_bytes) == plan.header_len, "fixed-width checksums keep the header length"
        header_crc = zlib.crc32(header_bytes)
        outs[0].write(struct.pack("<4sIQII", C.MAGIC, plan.version, len(header_bytes), header_crc, 0)
                      + header_bytes, 0)
        for k in range(1, len(outs)):
            outs[k].write(struct.pack("<4sIIII", C.PART_MAGIC, plan.version, k, len(outs), header_crc), 0)
        for out in outs:
            out.fsync()
        for k in list(range(1, len(outs))) + [0]:  # main file last: its presence means complete
            os.rename(partials[k], finals[k])
        fsync_dir(directory)
    except BaseException:
        for out in outs:
            out.close()
        outs = []
        for p in partials:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        raise
    finally:
        for out in outs:
            out.close()
    return plan


def default_threads() -> int:
    """CPU cores, at least 4 (each thread also keeps one read and one write in flight), at most 8."""
    return min(8, max(4, os.cpu_count() or 1))


def _write_data(plan: Plan, outs: list, threads: Optional[int], progress: bool) -> list:
    """Run every tensor and slot job on a thread pool; returns crcs aligned with plan.placed."""
    threads = threads or default_threads()
    crcs = [None if isinstance(e, TensorEntry) else [0] * e.num_experts for e, _, _ in plan.placed]
    total = sum(e.nbytes for e, _, _ in plan.placed)
    stage_size = max([TENSOR_STAGE] + [e.slot_stride for e, _, _ in plan.placed if isinstance(e, BankEntry)])
    local = threading.local()

    def stage() -> np.ndarray:  # this thread's buffer, reused by all its jobs
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = np.frombuffer(aligned_buffer(stage_size), dtype=np.uint8)
        return buf

    bar = _progress_bar(total) if progress else None
    slots = threading.BoundedSemaphore(2 * threads)
    failed: list = []
    prefetcher = _Prefetcher(PREFETCH_AHEAD)

    def run(job):
        try:
            if not failed:
                job(stage())
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            failed.append(e)
        finally:
            slots.release()

    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ftw-write")
    try:
        jobs = list(_jobs(plan, outs, crcs, bar))
        prefetcher.start([(n, hook) for n, hook, _ in jobs])
        for nbytes, _, job in jobs:
            while not slots.acquire(timeout=0.2):  # short waits keep Ctrl-C responsive
                pass
            if failed:
                slots.release()
                break
            prefetcher.advance(nbytes)
            pool.submit(run, job)
        pool.shutdown(wait=True)
    except BaseException:  # Ctrl-C or a job-generator error: no worker may outlive the fds
        failed.append(None)  # stop workers from starting new jobs
        pool.shutdown(wait=True, cancel_futures=True)
        _close_bar(bar, ok=False)
        raise
    finally:
        prefetcher.stop()
    errors = [e for e in failed if e is not None]
    _close_bar(bar, ok=not errors)
    if errors:
        raise errors[0]
    return crcs


def _jobs(plan: Plan, outs: list, crcs: list, bar) -> Iterator[tuple]:
    """(source bytes, prefetch hook or None, job(stage)) per tensor and per expert slot, in data
    order (streams layer by layer)."""
    for i, (entry, file_index, offset) in enumerate(plan.placed):
        start = plan.files[file_index]["data_offset"] + offset
        out = outs[file_index]
        if isinstance(entry, TensorEntry):
            yield (entry.nbytes, entry.prefetch,
                   lambda buf, i=i, entry=entry, start=start, out=out:
                   _write_tensor(entry, out, start, buf, crcs, i, bar))
        else:
            for e in range(entry.num_experts):
                hook = None if entry.prefetch is None else (lambda e=e, f=entry.prefetch: f(e))
                yield (entry.slot_stride, hook,
                       lambda buf, i=i, e=e, entry=entry, start=start + e * entry.slot_stride, out=out:
                       _write_slot(entry, e, out, start, buf, crcs, i, bar))


def _write_tensor(entry: TensorEntry, out: OutputFile, start: int, buf: np.ndarray, crcs: list,
                  i: int, bar) -> None:
    """Stream the tensor's chunks through `buf`: full buffers, then the tail padded to ALIGNMENT
    with the zeros the file holds there anyway (SPEC.md §5)."""
    crc, pos, fill, written = 0, 0, 0, 0
    for chunk in entry.read():
        mv = memoryview(chunk).cast("B")
        if pos + len(mv) > entry.nbytes:
            break
        crc = zlib.crc32(mv, crc)
        pos += len(mv)
        src = np.frombuffer(mv, dtype=np.uint8)
        while len(src):
            n = min(len(buf) - fill, len(src))
            buf[fill:fill + n] = src[:n]
            fill, src = fill + n, src[n:]
            if fill == len(buf):
                out.write_block(memoryview(buf), start + written)
                written, fill = written + fill, 0
        if bar is not None:
            bar.update(len(mv))
    if pos != entry.nbytes:
        raise FTWError(f"internal: tensor {entry.name} produced a wrong number of bytes "
                       f"(expected {entry.nbytes}); please report this")
    if fill:
        padded = C.round_up(fill, C.ALIGNMENT)
        buf[fill:padded] = 0
        out.write_block(memoryview(buf[:padded]), start + written)
    crcs[i] = crc


def _write_slot(entry: BankEntry, e: int, out: OutputFile, start: int, buf: np.ndarray, crcs: list,
                i: int, bar) -> None:
    """Assemble slot e in `buf` (projections at their offsets, zeros between, SPEC.md §5.2),
    checksum it, write it with one aligned write."""
    slot = buf[:entry.slot_stride]
    views, pos = {}, 0
    np_dtype = np.dtype(C.NUMPY_DTYPES[entry.dtype])
    for proj in entry.projections:
        off, nbytes = proj["offset"], proj["nbytes"]
        slot[pos:off] = 0
        view = slot[off:off + nbytes]  # a quantized projection: its SPEC.md §9.2 bytes as they are
        quantized = entry.quant != C.QUANT_NONE and proj["name"] not in C.BIAS_PROJECTIONS
        views[proj["name"]] = view if quantized else view.view(np_dtype).reshape(proj["shape"])
        pos = off + nbytes
    slot[pos:] = 0
    if entry.read_expert_into is not None:
        entry.read_expert_into(e, views)
    else:
        arrays = entry.read_expert(e)
        for proj in entry.projections:
            a = np.ascontiguousarray(arrays[proj["name"]])
            if a.nbytes != proj["nbytes"]:
                raise FTWError(f"internal: {C.bank_name(entry.layer)} expert {e} {proj['name']} has "
                               f"{a.nbytes} bytes, expected {proj['nbytes']}; please report this")
            views[proj["name"]].reshape(-1).view(np.uint8)[:] = a.reshape(-1).view(np.uint8)
    crcs[i][e] = zlib.crc32(slot)
    out.write_block(memoryview(slot), start)
    if bar is not None:
        bar.update(entry.slot_stride)


class _Prefetcher:
    """Calls the jobs' prefetch hooks on its own thread, at most `ahead` source bytes beyond the
    jobs already submitted, so the disk always has reads queued while workers checksum and
    write (a hook is a hint, e.g. posix_fadvise(WILLNEED); it may block while it queues)."""

    def __init__(self, ahead: int):
        self.ahead = ahead
        self.submitted = 0
        self.cond = threading.Condition()
        self.stopped = False
        self.thread = None

    def start(self, hooks: list) -> None:
        if any(hook is not None for _, hook in hooks):
            self.thread = threading.Thread(target=self._run, args=(hooks,), name="ftw-prefetch", daemon=True)
            self.thread.start()

    def advance(self, nbytes: int) -> None:
        with self.cond:
            self.submitted += nbytes
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join()

    def _run(self, hooks: list) -> None:
        done = 0
        for nbytes, hook in hooks:
            with self.cond:
                while not self.stopped and done - self.submitted >= self.ahead:
                    self.cond.wait()
                if self.stopped:
                    return
            if hook is not None:
                try:
                    hook()
                except Exception:  # noqa: BLE001 - a hint; the job itself reports real errors
                    pass
            done += nbytes


def _close_bar(bar, ok: bool) -> None:
    if bar is not None:
        bar.leave = ok  # on failure the error line replaces the bar
        bar.close()


def _progress_bar(total: int):
    from tqdm import tqdm
    # disable=None: no bar when stderr is not a terminal (logs, CI)
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc="convert",
                dynamic_ncols=True, smoothing=0.1, disable=None)


__all__ = ["write", "TensorEntry", "BankEntry", "Plan", "plan_layout", "dumps", "tensor_sort_key",
           "tensor_from_array", "bank_from_arrays"]
